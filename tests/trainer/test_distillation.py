"""On-policy distillation (roles/teacher.py, losses/distill.py): the reverse-KL advantages and the
top-k loss through the trainer's own passes equal their formulas on a tiny student / teacher pair,
a teacher equal to the student gives no signal and no update, context distillation aligns the
teacher's positions with the student's response tokens (packed and unpacked), and a teacher with
another vocabulary is one clear error before any weight loads."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import make_char_tokenizer, random_rollout
from tiny_runs import GUESS_YAML, assert_step_runs_the_planned_programs, read_metrics, tiny_config

from jaxrl_llm.batching import StepRows, plan_chunks
from jaxrl_llm.config import ActorSpec, ConfigError
from jaxrl_llm.config.spec import DistillSpec, ModelSpec
from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.losses.distill import topk_forward_kl
from jaxrl_llm.models import ModelConfig, compute_logits, init_params
from jaxrl_llm.models.moe import active_params_of
from jaxrl_llm.roles.actor import actor_loss, update_actor
from jaxrl_llm.roles.experience import Experience, log_probs_no_grad, mix_advantages, teacher_no_grad
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.roles.teacher import (
    distill_signal,
    teacher_messages,
    teacher_prompt_ids,
    with_prompts,
)
from jaxrl_llm.roles.trained import check_vocabulary
from jaxrl_llm.roles.update import denominators
from jaxrl_llm.rollout.batch import Rollout

CFG = ModelConfig.tiny("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
N, P, R, T = 8, 5, 6, 0.7
ACTOR = ActorSpec(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                  clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                  kl_loss_type="low_var_kl", temperature=T, compute_dtype="float32", remat="none",
                  loss_scale_factor=None, loss_kwargs=(), ppo_epochs=1, shuffle=False)


def _spec(signal="reverse_kl", **kw) -> DistillSpec:
    teacher = ModelSpec(path="tiny:llama", param_dtype="float32", tiny=())
    return DistillSpec(signal=signal, coef=kw.pop("coef", 1.0), reward_coef=kw.pop("reward_coef", 1.0),
                       discount=kw.pop("discount", 0.0), topk=kw.pop("topk", 5), teacher=teacher,
                       param_offload=False, **kw)


def _batch(seed=0):
    ids, mask, resp_mask, prompt_len, resp_len = random_rollout(np.random.default_rng(seed), N, P, R)
    return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(resp_mask, jnp.float32), prompt_len, resp_len


def _teacher(params, ids, mask, resp, topk=0, packing=None, micro_rows=N):
    return teacher_no_grad(params, ids, mask, resp, packing, model_cfg=CFG, temperature=T,
                           compute_dtype="float32", micro_rows=micro_rows, topk=topk)


def _student(params, ids, mask, resp):
    return log_probs_no_grad(params, ids, mask, resp, model_cfg=CFG, temperature=T, compute_dtype="float32",
                             micro_rows=N)


def test_reverse_kl_advantages_equal_the_formula():
    student, teacher = init_params(CFG, jax.random.PRNGKey(0)), init_params(CFG, jax.random.PRNGKey(1))
    ids, mask, resp, _, _ = _batch()
    out = _teacher(teacher, ids, mask, resp)
    student_lp = _student(student, ids, mask, resp)
    teacher_lp = response_log_probs(teacher, CFG, ids, mask, R, temperature=T)
    np.testing.assert_allclose(out["log_probs"], teacher_lp, atol=1e-6)
    signal, metrics = distill_signal(out, student_lp, resp, _spec(coef=0.5, reward_coef=2.0))
    want = (np.asarray(teacher_lp) - np.asarray(student_lp)) * np.asarray(resp)
    np.testing.assert_allclose(signal.advantages, want, atol=1e-6)
    tokens = float(resp.sum())
    np.testing.assert_allclose(metrics["distill/reverse_kl"], -want.sum() / tokens, rtol=1e-5)
    np.testing.assert_allclose(metrics["distill/teacher_logprob"], float((teacher_lp * resp).sum()) / tokens,
                               rtol=1e-5)
    task = jnp.asarray(np.random.default_rng(1).normal(size=(N, R)), jnp.float32)
    np.testing.assert_allclose(mix_advantages(task, signal.advantages, 2.0, 0.5), 2.0 * task + 0.5 * want,
                               rtol=1e-6, atol=1e-6)


def _experience(ids, mask, resp, out, advantages):
    return Experience(input_ids=ids, attention_mask=mask, response_mask=resp, old_log_probs=jnp.zeros((N, R)),
                      advantages=advantages, returns=jnp.zeros((N, R)), teacher_topk_ids=out.get("topk_ids"),
                      teacher_topk_log_probs=out.get("topk_log_probs"))


def test_topk_loss_in_the_actor_equals_a_dense_reference():
    student, teacher = init_params(CFG, jax.random.PRNGKey(0)), init_params(CFG, jax.random.PRNGKey(1))
    ids, mask, resp, _, _ = _batch(1)
    out = _teacher(teacher, ids, mask, resp, topk=5)
    exp = _experience(ids, mask, resp, out, jnp.zeros((N, R)))  # A = 0: the loss is the top-k term alone
    s = dataclasses.replace(ACTOR, distill_topk_coef=0.3)
    fused = lambda p: actor_loss(p, exp, denominators(resp), model_cfg=CFG, s=s)[0]  # noqa: E731

    def dense(p):
        logits = compute_logits(p, CFG, ids, mask)[:, P - 1:-1] / T  # the [B, T, V] reference
        student_topk = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), out["topk_ids"], axis=-1)
        return 0.3 * agg_loss(topk_forward_kl(student_topk, out["topk_log_probs"]), resp, "token-mean")

    teacher_logits = compute_logits(teacher, CFG, ids, mask)[:, P - 1:-1] / T
    top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(teacher_logits, -1), 5)
    keep = np.asarray(resp)[..., None] > 0
    np.testing.assert_array_equal(np.where(keep, out["topk_ids"], 0), np.where(keep, top_ids, 0))
    np.testing.assert_allclose(np.where(keep, out["topk_log_probs"], 0), np.where(keep, top_lp, 0), atol=1e-5)
    (v_f, g_f), (v_d, g_d) = jax.value_and_grad(fused)(student), jax.value_and_grad(dense)(student)
    assert float(v_f) > 1e-3
    np.testing.assert_allclose(v_f, v_d, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g_f, g_d)


@pytest.mark.parametrize("signal", ["reverse_kl", "topk_forward_kl"])
def test_teacher_equal_to_student_gives_no_signal_and_no_update(signal):
    params = init_params(CFG, jax.random.PRNGKey(0))
    ids, mask, resp, _, _ = _batch(2)
    topk = 5 if signal == "topk_forward_kl" else 0
    out = _teacher(params, ids, mask, resp, topk=topk)
    distill, metrics = distill_signal(out, _student(params, ids, mask, resp), resp, _spec(signal, reward_coef=0.0))
    assert abs(float(metrics["distill/reverse_kl"])) < 1e-6
    advantages = mix_advantages(jnp.ones((N, R)), distill.advantages, 0.0, 1.0)  # pure distillation
    np.testing.assert_allclose(advantages, 0.0, atol=1e-6)
    s = dataclasses.replace(ACTOR, distill_topk_coef=1.0 if topk else 0.0)
    tx = optax.sgd(1.0)
    update = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=s, tx=tx, num_mini_batches=1,
                                       num_micro_batches=1))
    new, _, m = update(params, tx.init(params), _experience(ids, mask, resp, out, advantages), jax.random.PRNGKey(0))
    assert float(m["actor/grad_norm"]) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), new, params)
    if topk:
        assert abs(float(m["actor/distill_topk_kl"])) < 1e-6


def _rollout(tokenizer, chats, response_lengths, n=2):
    """A rollout of `chats` (n samples each) whose responses are random ids, student prompt = the chat."""
    from jaxrl_llm.data.prompts import encode_prompts
    from jaxrl_llm.sampler import left_pad

    rng = np.random.default_rng(3)
    prompts = [p for p in encode_prompts(chats, tokenizer, apply_chat_template=True) for _ in range(n)]
    pids, pmask = left_pad(prompts, 0)
    rows = len(prompts)
    resp_mask = (np.arange(R)[None] < np.asarray(response_lengths)[:, None]).astype(np.int32)
    resp = rng.integers(4, 60, size=(rows, R)).astype(np.int32)
    meta = {"raw_prompt": np.asarray([c for c in chats for _ in range(n)] + [None], dtype=object)[:-1]}
    return Rollout(input_ids=jnp.asarray(np.concatenate([pids, resp], 1)),
                   attention_mask=jnp.asarray(np.concatenate([pmask, resp_mask], 1)),
                   response_mask=jnp.asarray(resp_mask, jnp.float32), rollout_log_probs=jnp.zeros((rows, R)),
                   token_level_scores=jnp.zeros((rows, R)), group_ids=np.repeat(np.arange(len(chats)), n),
                   scores=np.zeros(rows, np.float32), response_lengths=np.asarray(response_lengths, np.int32),
                   prompt_lengths=np.asarray([len(p) for p in prompts], np.int32), texts=[""] * rows,
                   prompt_texts=[], meta=meta, reward_extra_info={}, reward_metrics={})


def test_context_distillation_aligns_teacher_and_student_tokens():
    tokenizer = make_char_tokenizer()
    cfg = dataclasses.replace(CFG, vocab_size=len(tokenizer))
    teacher = init_params(cfg, jax.random.PRNGKey(5))
    chats = [[{"role": "user", "content": "What is 2+2?"}],
             [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
             "Name a colour, please, any colour at all."]
    spec = _spec(system_prompt="Answer with a number.", prompt_template="Q: {prompt}",
                 fewshot=(("user", "Q: 1+1"), ("assistant", "2")))
    rollout = _rollout(tokenizer, chats, [6, 3, 1, 5, 2, 4])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    prompts = teacher_prompt_ids(rollout.meta["raw_prompt"], rollout.group_ids, spec, tokenizer)
    seen = with_prompts(rollout, prompts, 0, mesh)
    assert seen.input_ids.shape[1] - R > rollout.input_ids.shape[1] - R  # the teacher's prompts are longer
    # perf/mfu counts the teacher's pass over these rows (bookkeeping/metrics.py): its own prompts, the
    # student's responses, at the teacher's size
    np.testing.assert_array_equal(np.asarray(seen.prompt_lengths), [len(p) for p in prompts])
    np.testing.assert_array_equal(np.asarray(seen.response_lengths), rollout.response_lengths)
    assert active_params_of(cfg, teacher) == sum(x.size for x in jax.tree.leaves(teacher))
    # expected: each row alone, unpadded: the teacher's own prompt, then the student's response tokens
    resp = np.asarray(rollout.input_ids)[:, -R:]
    want = np.zeros((6, R), np.float32)
    for i, chat in enumerate(rollout.meta["raw_prompt"]):
        text = tokenizer.apply_chat_template(teacher_messages(chat, spec), add_generation_prompt=True, tokenize=False)
        assert text.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>") and "Q: 1+1" in text
        rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(prompts[i], rendered)
        n = int(rollout.response_lengths[i])
        row = np.asarray(rendered + resp[i, :n].tolist())[None]
        logp = jax.nn.log_softmax(compute_logits(teacher, cfg, jnp.asarray(row), jnp.ones_like(row)) / T, -1)[0]
        want[i, :n] = [logp[len(rendered) - 1 + j, resp[i, j]] for j in range(n)]
    args = (teacher, seen.input_ids, seen.attention_mask, seen.response_mask)
    kw = dict(model_cfg=cfg, temperature=T, compute_dtype="float32")
    unpacked = teacher_no_grad(*args, micro_rows=6, **kw)["log_probs"]
    np.testing.assert_allclose(unpacked * seen.response_mask, want, atol=1e-5)
    rows = StepRows.of_lengths(seen.prompt_lengths, seen.response_lengths, seen.input_ids.shape[1], R,
                               prompt_groups=seen.group_ids)
    packed = teacher_no_grad(*args, plan_chunks(rows, 6, 1), micro_rows=6, **kw)["log_probs"]
    np.testing.assert_allclose(packed, want, atol=1e-5)


def test_teacher_messages_replace_the_system_prompt_and_template_the_last_user_message():
    spec = _spec(system_prompt="S", prompt_template="<<{prompt}>>", fewshot=(("user", "u"), ("assistant", "a")))
    chat = [{"role": "system", "content": "old"}, {"role": "user", "content": "x {y}"},
            {"role": "assistant", "content": "z"}, {"role": "user", "content": "last"}]
    assert teacher_messages(chat, spec) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "x {y}"}, {"role": "assistant", "content": "z"},
        {"role": "user", "content": "<<last>>"}]
    assert teacher_messages("hi", _spec()) == [{"role": "user", "content": "hi"}]


NAMES = dict(key="algorithm.distillation.teacher.path", names=("student", "teacher"), purpose="distillation")


def test_a_different_vocabulary_is_one_clear_error():
    tok = make_char_tokenizer()
    cfg = dataclasses.replace(CFG, vocab_size=len(tok))
    with pytest.raises(ConfigError, match="vocabulary has 64 tokens, the student's 104"):
        check_vocabulary(cfg, tok, CFG, tok, "teacher/", **NAMES)
    shuffled = _swapped_char_tokenizer()
    with pytest.raises(ConfigError, match="tokenizers differ at .* sampled ids"):
        check_vocabulary(cfg, tok, cfg, shuffled, "teacher/", **NAMES)


def _swapped_char_tokenizer():
    """The char tokenizer with its characters' ids reversed (same size, another vocabulary)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = list(dict.fromkeys(string.printable))[::-1]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])


def _checked_before_loading(tmp_path, monkeypatch, overrides, match):
    """A second model of another vocabulary (an HF folder with a 256-token tokenizer) at `overrides`'
    path ('<folder>'): one ConfigError matching `match`, raised before any weight loads."""
    from tiny_models import build_hf_model

    import jaxrl_llm.roles.draft as draft_module
    import jaxrl_llm.trainer.build as build_module
    from jaxrl_llm.trainer import Trainer

    folder = tmp_path / "other"
    build_hf_model("llama", folder)
    make_char_tokenizer().save_pretrained(folder)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the vocabularies were checked")

    for module in (build_module, draft_module):
        monkeypatch.setattr(module, "load_model", no_load)
    cfg = tiny_config(tmp_path / "run", **{k: str(folder) if v == "<folder>" else v for k, v in overrides.items()})
    with pytest.raises(ConfigError, match=match):
        Trainer(cfg)


def test_vocabulary_is_checked_before_any_weight_loads(tmp_path, monkeypatch):
    _checked_before_loading(tmp_path, monkeypatch, {"algorithm.distillation.enable": True,
                                                    "algorithm.distillation.teacher.path": "<folder>"},
                            r"algorithm\.distillation\.teacher\.path=.*vocabulary has 256 tokens")


@pytest.mark.parametrize("signal", ["reverse_kl", "topk_forward_kl"])
def test_distillation_runs_packed_as_unpacked(tmp_path, signal):
    from jaxrl_llm.trainer.trainer import Trainer

    def run(name, packed):
        cfg = tiny_config(tmp_path / name, **{
            "algorithm.distillation.enable": True, "algorithm.distillation.signal": signal,
            "algorithm.distillation.teacher.path": "tiny:llama", "algorithm.distillation.topk": 4,
            "algorithm.distillation.teacher.system_prompt": "Be brief.", "trainer.total_training_steps": 1,
            "actor_rollout_ref.model.use_remove_padding": packed,
            "actor_rollout_ref.model.tiny.seed": 0})
        Trainer(cfg).fit()
        return read_metrics(tmp_path / name)[-1]

    packed, unpacked = run("packed", True), run("unpacked", False)
    keys = ["distill/reverse_kl", "distill/teacher_logprob", "actor/pg_loss", "actor/grad_norm"]
    if signal == "topk_forward_kl":
        keys.append("actor/distill_topk_kl")
        assert packed["actor/distill_topk_kl"] > 0
    for k in keys:
        np.testing.assert_allclose(packed[k], unpacked[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert packed["timing_s/teacher"] > 0 and abs(packed["distill/reverse_kl"]) > 0


def test_distillation_with_a_lora_student_and_the_memory_plan(tmp_path):
    from jaxrl_llm.trainer.trainer import Trainer

    cfg = tiny_config(tmp_path, **{
        "algorithm.distillation.enable": True, "algorithm.distillation.signal": "topk_forward_kl",
        "algorithm.distillation.teacher.path": "tiny:llama", "algorithm.distillation.topk": 4,
        "algorithm.distillation.teacher.fewshot": [{"role": "user", "content": "What is 1 + 1?"},
                                                   {"role": "assistant", "content": "2"}],
        "algorithm.distillation.reward_coef": 0.0, "actor_rollout_ref.model.lora_rank": 4,
        "trainer.memory_plan": True, "trainer.total_training_steps": 1})
    trainer = Trainer(cfg)
    table = trainer.memory_plan.table()
    assert "\nteacher " in table and "\nupdate_actor " in table
    row = trainer.fit()
    assert_step_runs_the_planned_programs(trainer, row)  # the teacher's pass, no reference (LoRA's base)
    # the teacher is the student's base: with the adapters at zero (B = 0) they agree, so the first
    # step's top-k KL is ~0 even though the teacher alone sees the worked example in its prompt
    assert abs(row["distill/reverse_kl"]) > 0 and row["actor/distill_topk_kl"] >= 0
    assert row["actor/pg_loss"] == 0.0  # reward_coef 0: the task advantage is off


def test_distillation_scores_model_tokens_of_multi_turn_trajectories(tmp_path):
    from jaxrl_llm.trainer.trainer import Trainer

    (tmp_path / "guess.yaml").write_text(GUESS_YAML)
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = tiny_config(tmp_path / "run", **{
        "data.synthetic.task": "guess", "data.max_prompt_length": 96, "data.max_response_length": 64,
        f"{mt}.enable": True, f"{mt}.interaction_config_path": str(tmp_path / "guess.yaml"),
        f"{mt}.max_assistant_turns": 3, "actor_rollout_ref.rollout.stop_token_ids": list(range(49152)),
        "actor_rollout_ref.rollout.engine": "static", "trainer.total_training_steps": 1,
        "algorithm.distillation.enable": True, "algorithm.distillation.teacher.path": "tiny:llama",
        "algorithm.distillation.teacher.system_prompt": "Guess well."})
    trainer = Trainer(cfg)
    batch = next(iter(trainer.train_loader))
    rollout, _ = trainer.rollout_source.sample(batch, jax.random.PRNGKey(0))
    assert float(rollout.response_mask.sum()) < float((np.asarray(rollout.attention_mask)[:, -64:]).sum())
    seen = trainer.teacher.rollout_for(rollout, trainer.mesh)
    signal, metrics = trainer.teacher.signal(
        seen, rollout.rollout_log_probs, batching=trainer.batching, micro=trainer.spec.plan.ref_log_prob,
        temperature=1.0, logprob_impl="auto", mesh=trainer.mesh)
    tool_tokens = (np.asarray(rollout.attention_mask)[:, -64:] > 0) & (np.asarray(rollout.response_mask) == 0)
    assert tool_tokens.any()
    assert np.all(np.asarray(signal.advantages)[tool_tokens] == 0.0)  # environment tokens carry no signal
    assert np.isfinite(float(metrics["distill/reverse_kl"]))


def test_distillation_resume_equals_uninterrupted(tmp_path):
    """The teacher is not saved (it is frozen, loaded again from its path): a run resumed from step 1
    logs the same metrics (distillation ones included) at steps 2-3 as the run that never stopped."""
    import tiny_runs

    from jaxrl_llm.trainer.trainer import Trainer

    def run(run_dir, steps, **extra):
        return Trainer(tiny_config(run_dir, **{
            "algorithm.distillation.enable": True, "algorithm.distillation.signal": "topk_forward_kl",
            "algorithm.distillation.teacher.path": "tiny:llama", "algorithm.distillation.topk": 4,
            "algorithm.distillation.teacher.system_prompt": "Be brief.", "trainer.total_training_steps": steps,
            **extra}))

    full = tmp_path / "full"
    run(full, 3, **{"trainer.save_freq": 1}).fit()
    tiny_runs.assert_resume_equals_uninterrupted(run, full, tmp_path / "resumed")
    assert all("distill/reverse_kl" in r for r in read_metrics(full))


def test_draft_model_vocabulary_is_checked_before_any_weight_loads(tmp_path, monkeypatch):
    """rollout.speculative's draft model reads the policy's token ids: the same check, the same moment."""
    key = "actor_rollout_ref.rollout.speculative"
    _checked_before_loading(tmp_path, monkeypatch, {f"{key}.method": "draft", f"{key}.draft_model.path": "<folder>"},
                            rf"^{key}\.draft_model\.path=.*the draft model's vocabulary has 256 tokens, the policy's")
