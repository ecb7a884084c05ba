"""LoRA on the real SmolLM2-135M: fresh adapters leave the policy exactly the base, and a few actor
updates on a 2-row batch (one rewarded answer, one penalised) move the log-probs the right way
through the adapters alone."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_actor_critic_update import SETTINGS

from jaxrl_llm.hf import load_gguf, load_tokenizer
from jaxrl_llm.models.lora import LoraConfig, init_lora, with_lora
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.roles.experience import Experience
from jaxrl_llm.roles.forward import response_log_probs

pytestmark = pytest.mark.slow


def test_smollm2_lora_updates_only_adapters_and_learns(smollm2_gguf):
    cfg, base = load_gguf(smollm2_gguf)
    tok = load_tokenizer(smollm2_gguf)
    chat = [{"role": "user", "content": "What is 3 + 4? Answer with only the number."}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt)["input_ids"]
    answers = [tok("7<|im_end|>")["input_ids"], tok("3 + 4 = 7<|im_end|>")["input_ids"]]
    r = max(len(a) for a in answers)
    ids = np.array([prompt_ids + a + [tok.pad_token_id] * (r - len(a)) for a in answers], np.int32)
    resp_mask = np.array([[1] * len(a) + [0] * (r - len(a)) for a in answers], np.float32)
    attn = np.concatenate([np.ones((2, len(prompt_ids)), np.int32), resp_mask.astype(np.int32)], 1)

    lora = LoraConfig(rank=8, alpha=16.0)
    ad = {"lora": init_lora(cfg, lora, jax.random.PRNGKey(0))}
    log_probs = jax.jit(lambda p: response_log_probs(p, cfg, jnp.asarray(ids), jnp.asarray(attn), r))
    lp_base = np.asarray(log_probs(base))
    np.testing.assert_array_equal(np.asarray(log_probs(with_lora(base, ad["lora"], lora.scale))), lp_base)

    batch = Experience(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
                       response_mask=jnp.asarray(resp_mask), old_log_probs=jnp.asarray(lp_base),
                       ref_log_probs=jnp.asarray(lp_base), advantages=jnp.asarray([[1.0], [-1.0]]) * resp_mask,
                       values=jnp.zeros((2, r)), returns=jnp.zeros((2, r)))
    s = dataclasses.replace(SETTINGS, use_kl_loss=False, entropy_coeff=0.0, temperature=1.0, clip_ratio_low=10.0,
                            clip_ratio_high=10.0, shuffle=False)
    tx = optax.adam(2e-3)
    update = jax.jit(functools.partial(update_actor, model_cfg=cfg, s=s, tx=tx, num_mini_batches=1,
                                       num_micro_batches=1, lora_scale=lora.scale))
    opt_state = tx.init(ad)
    for i in range(3):
        ad, opt_state, metrics = update(ad, opt_state, batch, jax.random.PRNGKey(i), None, None, base)
        assert float(metrics["actor/grad_norm"]) > 0
    lp = np.asarray(log_probs(with_lora(base, ad["lora"], lora.scale)))
    seq = lambda x: (x * resp_mask).sum(1)  # noqa: E731
    assert seq(lp)[0] > seq(lp_base)[0] + 0.1  # the rewarded answer became likelier ...
    assert seq(lp)[1] < seq(lp_base)[1] - 0.1  # ... the penalised one less likely
    np.testing.assert_array_equal(np.asarray(log_probs(base)), lp_base)  # the base is untouched
