"""A tiny decoder-shaped param tree with logical axes, a batch, and a loss over them, shared by
the sharding tests and the 2-process worker (plain numpy / jax; no model code)."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.sharding import with_activation_constraint

VOCAB, EMBED, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 256, 64, 2, 4, 1, 16, 128
LM_VOCAB = 98  # divisible by 2, not by 4 or 8: exercises the replication fallback
GLOBAL_BATCH, LENGTH = 16, 8


def logical_axes() -> dict:
    return {
        "embed": ("vocab", "embed"),
        "layers": {
            "wq": ("layers", "embed", "heads", "head_dim"),
            "wk": ("layers", "embed", "kv_heads", "head_dim"),
            "wo": ("layers", "heads", "head_dim", "embed"),
            "up": ("layers", "embed", "mlp"),
            "down": ("layers", "mlp", "embed"),
            "norm": ("layers", "embed"),
        },
        "lm_head": ("embed", "vocab"),
        "final_norm": ("embed",),
        "scale": None,
    }


def make_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)

    return {
        "embed": w(VOCAB, EMBED),
        "layers": {
            "wq": w(LAYERS, EMBED, HEADS, HEAD_DIM),
            "wk": w(LAYERS, EMBED, KV_HEADS, HEAD_DIM),
            "wo": w(LAYERS, HEADS, HEAD_DIM, EMBED) / 4,
            "up": w(LAYERS, EMBED, MLP),
            "down": w(LAYERS, MLP, EMBED),
            "norm": (1 + 0.1 * rng.standard_normal((LAYERS, EMBED))).astype(np.float32),
        },
        "lm_head": w(EMBED, LM_VOCAB),
        "final_norm": np.ones((EMBED,), np.float32),
        "scale": np.float32(0.5),
    }


def make_batch(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((GLOBAL_BATCH, LENGTH, EMBED)).astype(np.float32),
            "target": rng.integers(0, LM_VOCAB, (GLOBAL_BATCH, LENGTH)).astype(np.int32)}


def _rms(h, w):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * w


def forward(params: dict, x: jax.Array) -> jax.Array:
    """Decoder-shaped maths (head/kv-head projections, MLP, tied-free LM head) -> logits [B,T,V']."""
    h = with_activation_constraint(x, ("batch", "length", "act_embed"))

    def block(h, p):
        a = _rms(h, p["norm"])
        q = jnp.einsum("bte,ehd->bthd", a, p["wq"])
        k = jnp.einsum("bte,ekd->btkd", a, p["wk"])
        q = with_activation_constraint(q, ("batch", "length", "act_heads", "act_head_dim"))
        scores = jnp.einsum("bthd,bskd->bhts", q, k) / np.sqrt(HEAD_DIM)  # kv head broadcast
        mix = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), q)
        h = h + jnp.einsum("bthd,hde->bte", mix, p["wo"])
        m = jax.nn.gelu(jnp.einsum("bte,ef->btf", _rms(h, p["norm"]), p["up"]))
        m = with_activation_constraint(m, ("batch", "length", "act_mlp"))
        h = h + jnp.einsum("btf,fe->bte", m, p["down"])
        return with_activation_constraint(h, ("batch", "length", "act_embed")), None

    h, _ = jax.lax.scan(block, h, params["layers"])
    logits = jnp.einsum("bte,ev->btv", _rms(h, params["final_norm"]), params["lm_head"]) * params["scale"]
    return with_activation_constraint(logits, ("batch", "length", "act_vocab"))


def loss_and_logits(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Mean token cross-entropy of the forward pass (a global mean: needs cross-device reductions)."""
    logits = forward(params, batch["x"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["target"][..., None], axis=-1)), logits


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    return loss_and_logits(params, batch)[0]


def loss_grad_metrics(params: dict, batch: dict) -> dict:
    """Loss, squared gradient norm and a plain batch sum in one program (one compile per mesh);
    under a multi-process mesh each of them needs cross-process collectives."""
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    grad_sq = sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))
    return {"loss": loss, "grad_sq": grad_sq, "x_sum": jnp.sum(batch["x"])}
