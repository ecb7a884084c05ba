"""The draft model of speculative decoding (`rollout.speculative.method='draft'`): a smaller model of
the policy's vocabulary that proposes tokens the policy verifies (sampler/engine/verify.py).

    spec = with_draft_config(spec, tokenizer)           # no weight read: its config and tokenizer,
                                                        # the vocabulary checked, its config filled in
    params = load_draft(spec, tokenizer, mesh=, seed=)  # None when the run does not draft

`rollout.speculative.draft_model.path` is an HF folder, a GGUF file, one of our checkpoints or
`tiny:<arch>` (tests: the policy's tiny dims, other weights). Its params are placed like the
policy's (the policy's shardings for its shapes) in the policy's param dtype; the engine decodes
from a compute-dtype copy made once per generation. The draft stays frozen while the policy trains,
so its drafts are kept less often as the policy moves away from it (rollout/spec_accept_rate).
"""
from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from jaxrl_llm.config import ConfigError
from jaxrl_llm.config.spec import ModelSpec, RunSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.roles.trained import check_vocabulary, load_model, model_config_of, tokenizer_of

KEY = "actor_rollout_ref.rollout.speculative.draft_model.path"


def draft_model_spec(spec: RunSpec) -> ModelSpec | None:
    """What to load as the draft model (None: the run does not draft)."""
    speculative = spec.rollout_engine.speculative
    if speculative is None or not speculative.uses_draft_model:
        return None
    if speculative.draft_path is None:
        raise ConfigError(f"{KEY}=None: required when actor_rollout_ref.rollout.speculative.method='draft'")
    return dataclasses.replace(spec.model, path=speculative.draft_path, override_config=(), lora=None)


def with_draft_config(spec: RunSpec, tokenizer: Tokenizer) -> RunSpec:
    """`spec` with the draft model's config in its rollout engine options, once its vocabulary is
    checked against the policy's (configs and tokenizers only: one ConfigError before any weight
    loads); `spec` itself when the run does not draft."""
    model = draft_model_spec(spec)
    if model is None:
        return spec
    try:
        draft_tokenizer = tokenizer_of(model, tokenizer, key=KEY)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    draft_cfg = model_config_of(model, draft_tokenizer)
    check_vocabulary(model_config_of(spec.model, tokenizer), tokenizer, draft_cfg, draft_tokenizer, model.path,
                     key=KEY, names=("policy", "draft model"), purpose="speculative decoding")
    opts = spec.rollout_engine
    assert opts.speculative is not None
    speculative = dataclasses.replace(opts.speculative, draft_cfg=draft_cfg)
    return dataclasses.replace(spec, rollout_engine=dataclasses.replace(opts, speculative=speculative))


def load_draft(spec: RunSpec, tokenizer: Tokenizer, *, mesh: Mesh, seed: int) -> dict | None:
    """The draft model's params on `mesh` (None when the run does not draft); `spec` from
    `with_draft_config`, whose config the loaded model must match."""
    model = draft_model_spec(spec)
    if model is None:
        return None
    draft_cfg, params = load_model(model, head="lm", mesh=mesh, tokenizer=tokenizer, seed=seed)
    speculative = spec.rollout_engine.speculative
    assert speculative is not None and speculative.draft_cfg == draft_cfg, "with_draft_config read another config"
    return params
