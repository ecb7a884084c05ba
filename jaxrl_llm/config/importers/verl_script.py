"""A veRL example script (`examples/*/run_*.sh`) read as the command line it runs, without running it.

    hydra_file, overrides = read_verl_script("run_qwen2-7b_math.sh")

The script's `python3 -m verl.trainer.main_ppo ... key=value ...` command (continuation lines
joined) gives the overrides; its `--config-path` / `--config-name` give the Hydra file. Shell
variables are expanded from the script's own plain assignments (`name=value`, `export name=value`,
`name=${name:-default}`) and the environment; a variable set in the environment wins over the
script's assignment, so `EXPERIMENT_NAME=x python launch/train.py --import_config=run.sh` sets one
the script computes with a command. Nothing in the script is executed: a command substitution
other than `$(pwd)` in a value that is used is an error naming the line and the variable, and so is
a variable that is set nowhere. `$@` / `$*` (the script's own extra arguments) expand to nothing:
pass extra overrides after `--` instead.
"""
from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping

from jaxrl_llm.config.schema import ConfigError

# the entry points whose command line is a veRL config (PPO trainer and its recipe variants)
ENTRY_POINTS = re.compile(r"-m\s+(verl\.trainer\.main_ppo|recipe\.[\w.]+\.main_\w+|verl\.trainer\.main_\w+)\b")
ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-=])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*)|([@*#0-9]))")
ARITHMETIC = re.compile(r"\$\(\((.*?)\)\)")
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)|`([^`]*)`")
ARITHMETIC_TEXT = re.compile(r"^[\d\s+\-*/%()]*$")


class ScriptError(ConfigError):
    """A script whose command line cannot be read without running it."""


ESCAPED_BLANK_COMMENT = re.compile(r"\\[ \t]+#")  # `\ # ...`: bash escapes the blank, the comment ends the line


def _logical_lines(text: str) -> list[tuple[int, str, int]]:
    """(first line number, line, last line number) with backslash continuations joined and comments
    outside quotes kept (shlex drops them later)."""
    out: list[tuple[int, str, int]] = []
    buffer, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not buffer:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        out.append((start, buffer + line, number))
        buffer = ""
    if buffer:  # the file ends on a continued line
        out.append((start, buffer, len(text.splitlines())))
    return out


def _check_not_cut(path: str, lines: list[str], last: int) -> None:
    """The veRL command's last line `last` (1-based) ends in `\\ # comment` while the next line goes on
    with overrides: bash ends the command there (the backslash escapes a blank, the comment ends the
    line), so those overrides never reach veRL. The script does not run as its author meant: an error."""
    if not ESCAPED_BLANK_COMMENT.search(lines[last - 1]) or last >= len(lines):
        return
    first_word = (lines[last].split() or [""])[0]
    if "=" in first_word:
        raise ScriptError(f"{path} line {last}: the backslash before '#' escapes a blank, so bash ends the veRL "
                          f"command on this line and runs line {last + 1} on ({first_word!r}, ...) as "
                          "commands of their own: the overrides there never reach veRL. Move the comment off the "
                          "continued line and import the script again")


class _Expander:
    def __init__(self, path: str, env: Mapping[str, str]):
        self.path, self.env = path, env
        self.values: dict[str, str | None] = {}  # None: set by a command we do not run
        self.why: dict[str, str] = {}

    def expand(self, text: str, line: int, *, strict: bool) -> str | None:
        """`text` with $VAR / ${VAR} / ${VAR:-default} / $(pwd) expanded; None (when not strict) if it
        needs a value we do not have."""
        def substitution(match: re.Match) -> str:
            command = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
            words = command.split()
            if words == ["pwd"]:
                return os.getcwd()
            if len(words) == 2 and words[0] in ("basename", "dirname"):
                target = self.expand(words[1].strip("'\""), line, strict=True) or ""
                return os.path.basename(target.rstrip("/")) if words[0] == "basename" else os.path.dirname(target)
            raise _Missing(f"$({command})", "a command substitution, which is not run")

        def variable(match: re.Match) -> str:
            name = match.group(1) or match.group(4)
            special = match.group(5)
            if special is not None:
                return "" if special in "@*" else self._missing(f"${special}", "a positional argument")
            if match.group(2) in ("-", "=") and self._lookup(name) is None:  # ${name:-default}
                return self.expand(match.group(3), line, strict=True) or ""
            return self._value(name)

        try:
            text = ARITHMETIC.sub(self._arithmetic, text)
            text = SUBSTITUTION.sub(substitution, text)
            return VARIABLE.sub(variable, text)
        except _Missing as missing:
            if not strict:
                return None
            raise ScriptError(f"{self.path} line {line}: {missing.what} is {missing.why}; set it in the environment "
                              "(it wins over the script's own assignment)") from None

    def _arithmetic(self, match: re.Match) -> str:
        """`$(( ... ))` over integers and the script's variables (digits and + - * / % only, evaluated)."""
        body = re.sub(r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda v: self._value(v.group(1)), match.group(1))
        if not ARITHMETIC_TEXT.match(body):
            raise _Missing(f"$(({match.group(1)}))", "arithmetic on values that are not integers")
        return str(int(eval(body.replace("/", "//"), {"__builtins__": {}})))  # only digits and operators remain

    def arithmetic(self, text: str, line: int) -> str:
        """`text` with its `$(( ))` expansions done (before the command is split into words)."""
        try:
            return ARITHMETIC.sub(self._arithmetic, text)
        except _Missing as missing:
            raise ScriptError(f"{self.path} line {line}: {missing.what} is {missing.why}") from None

    def _lookup(self, name: str) -> str | None:
        """The environment's value (it wins), else the script's; None when unset or set by a command."""
        return self.env.get(name) if name in self.env else self.values.get(name)

    def _value(self, name: str) -> str:
        value = self._lookup(name)
        if value is None:
            raise _Missing(f"${name}", self.why.get(name, "set neither in the script nor in the environment"))
        return value

    @staticmethod
    def _missing(what: str, why: str) -> str:
        raise _Missing(what, why)

    def assign(self, name: str, raw: str, line: int) -> None:
        if name in self.env:
            return  # the environment wins: the way to give a value the script computes
        try:
            words = shlex.split(raw, comments=True, posix=True)
        except ValueError:
            words = [raw]
        value = self.expand(" ".join(words) if words else "", line, strict=False)
        self.values[name] = value
        if value is None:
            self.why[name] = f"set on line {line} from a command that is not run ({raw.strip()})"


class _Missing(Exception):
    def __init__(self, what: str, why: str):
        super().__init__(what)
        self.what, self.why = what, why



def read_verl_script(path: str, env: Mapping[str, str] | None = None) -> tuple[str | None, list[str]]:
    """A veRL shell script -> (the YAML file its --config-path / --config-name name, or None; its
    `key=value` overrides). Raises ScriptError naming the line for what cannot be read."""
    from jaxrl_llm.config.importers import split_hydra_config

    if not os.path.isfile(path):
        raise ScriptError(f"{path}: script not found")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    expander = _Expander(path, os.environ if env is None else env)
    command: tuple[int, str] | None = None
    for number, line, last in _logical_lines(text):
        found = ENTRY_POINTS.search(line)
        if found:
            if command is not None:
                raise ScriptError(f"{path} line {number}: a second veRL command (the first is on line {command[0]}); "
                                  "give a script that runs one")
            _check_not_cut(path, text.splitlines(), last)
            command = (number, line[found.end():])
            continue
        assigned = ASSIGNMENT.match(line)
        if assigned and command is None:
            expander.assign(assigned.group(1), assigned.group(2), number)
    if command is None:
        raise ScriptError(f"{path}: no `python3 -m verl.trainer.main_ppo ...` command found")
    number, args = command
    args = expander.arithmetic(args, number)
    try:
        words = shlex.split(args, comments=True, posix=True)
    except ValueError as err:
        raise ScriptError(f"{path} line {number}: cannot split the command line ({err})") from None
    items: list[str] = []
    for word in words:
        if word in ("$@", "$*", "${@}", "${*}") or not word.strip():
            continue  # the script's own arguments; an escaped blank (`\ ` before a comment: bash ends the line)
        if word in ("|", "||", "&&", ";", "&") or word.startswith(("2>", ">", "1>", "|")):
            break  # the command ends (a pipe to tee, a redirect)
        expanded = expander.expand(word, number, strict=True)
        assert expanded is not None
        items.append(expanded)
    return split_hydra_config(items)


__all__ = ["ScriptError", "read_verl_script"]
