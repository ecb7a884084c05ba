"""config/checks.py: run names, DAPO's filter metric, model.override_config (validated, and applied
at load for real), no-effect keys warned about, and what model / tokenizer / user-code paths hold."""
import json
import logging

import jax
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, apply_overrides, default_config, validate_config
from jaxrl_llm.config.spec import ModelSpec
from jaxrl_llm.models import ModelConfig, compute_logits, init_params
from jaxrl_llm.models.config import with_hf_overrides


def _cfg(*overrides):
    base = ["actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok", "data.train_files=train.parquet",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
    return apply_overrides(default_config(), base + list(overrides))


def check(*overrides, paths=False):
    return validate_config(_cfg(*overrides), dp_size=1, check_paths=paths)


@pytest.mark.parametrize("key", ["trainer.project_name", "trainer.experiment_name"])
@pytest.mark.parametrize("name", ["a/b", "../up", "x\\y", "..", "", " padded"])
def test_run_names_are_plain(key, name):
    with pytest.raises(ConfigError, match=rf"^{key}=.*plain, non-empty name"):
        check(f"{key}='{name}'")


def test_run_names_accepted():
    out = check("trainer.project_name=my-proj_2", "trainer.experiment_name=grpo.v1")
    assert out.trainer.default_local_dir == "checkpoints/my-proj_2/grpo.v1"


def test_filter_groups_metric():
    fg = "algorithm.filter_groups"
    check(f"{fg}.enable=true", f"{fg}.metric=acc")  # math_dapo returns it
    check(f"{fg}.enable=true", f"{fg}.metric=seq_final_reward")
    check(f"{fg}.metric=whatever")  # not checked while the filter is off
    with pytest.raises(ConfigError, match=r"^algorithm.filter_groups.metric='accuracy': the built-in scorers"):
        check(f"{fg}.enable=true", f"{fg}.metric=accuracy")
    with pytest.raises(ConfigError, match=r"^algorithm.filter_groups.metric='acc': a reward model"):
        check(f"{fg}.enable=true", f"{fg}.metric=acc", "reward_model.enable=true", "reward_model.model.path=rm")
    check(f"{fg}.enable=true", f"{fg}.metric=accuracy", "custom_reward_function.path=my_reward.py")


def test_override_config_keys(caplog):
    out = check("actor_rollout_ref.model.override_config={rope_theta: 500000.0, max_position_embeddings: 512}")
    assert out.actor_rollout_ref.model.override_config.rope_theta == 500000.0
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.override_config.num_hidden_layers: changes"):
        check("actor_rollout_ref.model.override_config.num_hidden_layers=4")
    with pytest.raises(ConfigError, match=r"^critic.model.override_config.vocab_size: changes"):
        check("critic.model.override_config.vocab_size=10")
    with caplog.at_level(logging.WARNING):
        check("actor_rollout_ref.model.override_config.attention_dropout=0.1")
    assert "actor_rollout_ref.model.override_config.attention_dropout has no effect in jaxrl_llm" in caplog.text


@pytest.mark.parametrize("override,key", [("actor_rollout_ref.rollout.calculate_log_probs=true",
                                           "actor_rollout_ref.rollout.calculate_log_probs=True"),
                                          ("trainer.max_critic_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2")])
def test_no_effect_keys_are_warned(caplog, override, key):
    with caplog.at_level(logging.WARNING):
        check(override)
    assert f"config key {key} has no effect in jaxrl_llm" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check()
    assert "no effect" not in caplog.text


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_hf_overrides_round_trip_and_replace(family):
    cfg = ModelConfig.tiny(family)
    assert with_hf_overrides(cfg, {}) is cfg
    assert with_hf_overrides(cfg, {"rope_theta": cfg.rope_theta}) == cfg
    out = with_hf_overrides(cfg, {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "eos_token_id": [2, 5]})
    assert (out.rope_theta, out.rms_norm_eps, out.eos_token_ids) == (1e6, 1e-5, (2, 5))
    scaled = with_hf_overrides(cfg, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert scaled.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert with_hf_overrides(scaled, {"max_position_embeddings": 64}).rope_scaling == scaled.rope_scaling
    with pytest.raises(ValueError, match="override_config.hidden_size"):
        with_hf_overrides(cfg, {"hidden_size": 32})


def test_override_config_reaches_the_loaded_model(monkeypatch):
    """roles.load_model applies it to whatever the loader read: the logits are those of a model
    with the new rope_theta."""
    from jaxrl_llm.roles import trained as roles

    base_cfg = ModelConfig.tiny("llama", num_hidden_layers=1, vocab_size=32)
    rng = np.random.default_rng(0)  # random weights without compiling an initialiser
    params = jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype),
                          jax.eval_shape(lambda: init_params(base_cfg, jax.random.PRNGKey(0))))
    monkeypatch.setattr(roles, "_load", lambda model, **_: (base_cfg, params))
    tiny = tuple(default_config().actor_rollout_ref.model.tiny.to_dict().items())
    spec = ModelSpec("some/hf_folder", "float32", tiny, (("rope_theta", 3.0),))
    cfg, loaded = roles.load_model(spec, head="lm", mesh=None, tokenizer=None, seed=0)
    assert loaded is params and cfg.rope_theta == 3.0 and cfg == with_hf_overrides(base_cfg, {"rope_theta": 3.0})
    plain, _ = roles.load_model(ModelSpec("some/hf_folder", "float32", tiny), head="lm",
                                mesh=None, tokenizer=None, seed=0)
    assert plain is base_cfg
    ids = np.arange(3, 19, dtype=np.int32)[None]
    mask = np.ones_like(ids)
    logits = jax.jit(compute_logits, static_argnums=1)
    a, b = np.asarray(logits(params, base_cfg, ids, mask)), np.asarray(logits(params, cfg, ids, mask))
    np.testing.assert_allclose(a[:, 0], b[:, 0], atol=1e-5)  # position 0: no rotation either way
    assert float(np.abs(a[:, 1:] - b[:, 1:]).max()) > 1e-3


def _hf_folder(path, config=None, weights=True, tokenizer=True):
    path.mkdir()
    config = config or ModelConfig.tiny(max_position_embeddings=4096).to_hf_config()
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def test_sources_checked_before_loading(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("{}\n")
    good = _hf_folder(tmp_path / "good")
    ok = [f"data.train_files={train}", f"actor_rollout_ref.model.path={good}", "data.tokenizer=null"]
    check(*ok, paths=True)
    gpt2 = {**ModelConfig.tiny(max_position_embeddings=4096).to_hf_config(), "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2"}
    v32 = {**gpt2, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}
    v4 = {**gpt2, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    cases = {
        "unsupported architecture 'GPT2LMHeadModel'": _hf_folder(tmp_path / "gpt2", gpt2),
        "unsupported architecture 'DeepseekV32ForCausalLM' (DeepSeek-V3.2's sparse attention":
            _hf_folder(tmp_path / "v32", v32),
        "unsupported architecture 'DeepseekV4ForCausalLM' (DeepSeek-V4's compressed sparse attention":
            _hf_folder(tmp_path / "v4", v4),
        "no model.safetensors": _hf_folder(tmp_path / "noweights", weights=False),
        "not a model folder (no config.json)": tmp_path / "empty",
    }
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "config.json").write_text("{not json")
    cases["cannot read config.json"] = tmp_path / "bad_json"
    for why, folder in cases.items():
        with pytest.raises(ConfigError) as err:
            check(*ok, f"actor_rollout_ref.model.path={folder}", paths=True)
        assert str(err.value).startswith(f"actor_rollout_ref.model.path='{folder}'") and why in str(err.value)
    short = "actor_rollout_ref.model.override_config.max_position_embeddings=1000"
    with pytest.raises(ConfigError, match=r"^data.max_prompt_length \+ data.max_response_length = 1024 exceeds the "
                                          r"context of actor_rollout_ref.model.path \(1000 positions\); .* yarn"):
        check(*ok, short, paths=True)
    # RoPE scaling extends it: YaRN x4 of the 1000 pre-training positions serves 4000
    yarn = "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 1000}"
    check(*ok, short, f"actor_rollout_ref.model.override_config.rope_scaling={yarn}", paths=True)
    with pytest.raises(ConfigError, match=r"exceeds actor_rollout_ref.model.path's max_position_embeddings=1000 "
                                          r"under dynamic NTK RoPE scaling"):
        check(*ok, short, "actor_rollout_ref.model.override_config.rope_scaling={rope_type: dynamic, factor: 4.0}",
              paths=True)
    notok = _hf_folder(tmp_path / "notok", tokenizer=False)
    with pytest.raises(ConfigError, match=r"^data.tokenizer=.*notok': no tokenizer in the folder"):
        check(*ok, f"actor_rollout_ref.model.path={notok}", paths=True)
    broken = tmp_path / "broken_reward.py"
    broken.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError, match=r"^custom_reward_function.path: importing .*broken_reward.py failed: "
                                          r"SystemExit"):
        check(*ok, f"custom_reward_function.path={broken}", paths=True)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(*a, **k):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"^custom_reward_function.name: .* has no attribute 'score_fn'"):
        check(*ok, f"custom_reward_function.path={reward}", "custom_reward_function.name=score_fn", paths=True)


def test_all_to_all_context_attention_needs_heads_that_split(tmp_path):
    """Ulysses splits each device's heads over mesh.context: a tiny model's and an HF folder's heads are checked
    before anything loads (ring takes any head count)."""
    train = tmp_path / "train.jsonl"
    train.write_text("{}\n")
    folder = _hf_folder(tmp_path / "model")  # 4 heads
    ok = [f"data.train_files={train}", f"data.tokenizer={folder}", "mesh.context=8", "mesh.fsdp=1"]
    for model in (f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.model.path=tiny:llama"):
        with pytest.raises(ConfigError, match=r"^mesh.context_attention=all_to_all: actor_rollout_ref.model has 4 "
                                              r"attention heads, 4 per device, which do not split over mesh.context=8"):
            check(*ok, model, "mesh.context_attention=all_to_all", paths=True)
        for fine in ("mesh.context_attention=ring", "mesh.context_attention=gather", "mesh.context=2"):
            check(*ok, model, "mesh.context_attention=all_to_all", fine, paths=True)


def _gguf_bytes(kvs, version=3):
    """A GGUF header with the given (key, type, payload bytes) entries and no tensors."""
    import struct

    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs))
    for key, kind, payload in kvs:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload
    return out


def test_gguf_header_is_read_without_parsing_the_vocabulary(tmp_path, smollm2_gguf):
    import struct

    from jaxrl_llm.config.checks import check_model_source
    from jaxrl_llm.hf.gguf_header import GGUFHeaderError, read_gguf_metadata

    tokens = [b"a", b"bc", b"<s>"]
    array = struct.pack("<IQ", 8, len(tokens)) + b"".join(struct.pack("<Q", len(t)) + t for t in tokens)
    ints = struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, 2, 3)
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf_bytes([("tokenizer.ggml.tokens", 9, array), ("x.ids", 9, ints),
                                  ("general.architecture", 8, struct.pack("<Q", 5) + b"llama"),
                                  ("llama.context_length", 4, struct.pack("<I", 1024))]))
    assert read_gguf_metadata(str(path), ("general.architecture", "llama.context_length", "x.ids")) == {
        "general.architecture": "llama", "llama.context_length": 1024, "x.ids": [1, 2, 3]}
    assert check_model_source("k", str(path)) == 1024
    path.write_bytes(_gguf_bytes([("general.architecture", 8, struct.pack("<Q", 5) + b"gpt2x")]))
    with pytest.raises(ConfigError, match=r"^k='.*m.gguf': unsupported GGUF architecture 'gpt2x'"):
        check_model_source("k", str(path))
    path.write_bytes(_gguf_bytes([("general.architecture", 8, struct.pack("<Q", 50) + b"llama")]))
    with pytest.raises(GGUFHeaderError, match="truncated"):
        read_gguf_metadata(str(path), ("general.architecture",))
    assert check_model_source("k", str(smollm2_gguf)) == 8192  # the real file: llama, 8k context


def test_the_picture_task_is_refused_for_a_text_policy():
    # its rows hold images (tests/data/test_data_images.py); no vision-language policy reads them yet
    with pytest.raises(ConfigError, match=r"^data.synthetic.task='shapes': its prompts are pictures"):
        check("data.synthetic.task=shapes", "data.tokenizer=x", "actor_rollout_ref.model.path=tiny:llama")
