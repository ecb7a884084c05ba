"""MATH scorer (`lighteval/MATH`, `HuggingFaceH4/MATH-500`, ...) with veRL's semantics: the last
`\\boxed{...}` (or `\\boxed ...` / `\\fbox{...}`) of the response, normalised with the Hendrycks
string rules (lm-evaluation-harness), compared with the normalised ground truth: 1.0 or 0.0."""
from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` (balanced braces), `\\boxed <x>` (up to `$`) or `\\fbox{...}`."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def closing_brace(text: str, start: int) -> int | None:
    """Index of the `}` that closes the first `{` at or after `start` (balanced), or None."""
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return end
    return None


def unbox(boxed: str) -> str:
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed "):]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part:  # veRL indexes part[0] here; the IndexError makes is_equiv compare verbatim
            raise ValueError("empty \\frac argument")
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    pieces = s.split("/")
    if len(pieces) != 2:
        return s
    try:
        a, b = int(pieces[0]), int(pieces[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " in s:
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("several unit annotations")
        return pieces[0]
    return s


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        out += "\\sqrt" + part if part.startswith("{") else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def normalise(s: str) -> str:
    """Hendrycks MATH answer normalisation (same steps and order as veRL's `strip_string`)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalise(a) == normalise(b)
    except Exception:  # a normalisation step rejected the string: compare verbatim, as veRL does
        return a == b


def compute_score(response: str, ground_truth: str) -> float:
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    try:
        answer = unbox(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
