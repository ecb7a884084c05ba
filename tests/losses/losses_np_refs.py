"""Hand-written numpy references of docs/algorithms.md (loops over rows and groups, float64)."""
from collections import defaultdict

import numpy as np


def mmean(x, m, axis=None):
    return (x * m).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def whiten(x, m):
    n = m.sum()
    assert n > 1
    mean = mmean(x, m)
    var = mmean((x - mean) ** 2, m) * n / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def groups(ids):
    out = defaultdict(list)
    for i, g in enumerate(ids):
        out[int(g)].append(i)
    return out


def gae(r, v, m, gamma, lam):
    b, t = r.shape
    adv = np.zeros((b, t))
    for i in range(b):
        nextv, last = 0.0, 0.0
        for j in reversed(range(t)):
            if m[i, j] > 0:
                delta = r[i, j] + gamma * nextv - v[i, j]
                last = delta + gamma * lam * last
                nextv = v[i, j]
            adv[i, j] = last
    return whiten(adv, m), adv + v


def grpo(r, m, ids, eps, norm):
    s = r.sum(-1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        x = s[rows]
        mean, std = (0.0, 1.0) if len(rows) == 1 else (x.mean(), x.std(ddof=1))
        out[rows] = (x - mean) / (std + eps) if norm else x - mean
    return out[:, None] * m


def grpo_vectorized(r, m, ids, eps, norm):
    s = r.sum(-1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        x = s[rows]
        n = len(rows)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = x.mean()
            var = ((x**2).sum() - x.sum() ** 2 / n) / max(n - 1, 1)
            std = np.sqrt(max(var, eps))
        out[rows] = (x - mean) / (std + eps) if norm else x - mean
    return out[:, None] * m


def grpo_passk(r, m, ids, eps, norm):
    s = r.sum(-1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        x = s[rows]
        order = np.argsort(-x, kind="stable")
        a = x[order[0]] - x[order[1]]
        if norm:
            a = a / (x.std(ddof=1) + eps)
        out[rows[order[0]]] = a
    return out[:, None] * m


def rloo(r, m, ids):
    s = r.sum(-1)
    out = s.copy()
    for rows in groups(ids).values():
        n = len(rows)
        if n > 1:
            out[rows] = n / (n - 1) * (s[rows] - s[rows].mean())
    return out[:, None] * m


def rloo_vectorized(r, m, ids):
    s = r.sum(-1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            out[i] = s[i] - np.mean(others) if others else 0.0
    return out[:, None] * m


def opo(r, m, ids):
    s, ln = r.sum(-1), m.sum(-1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        base = 0.0 if len(rows) == 1 else (ln[rows] * s[rows]).sum() / ln[rows].sum()
        out[rows] = s[rows] - base
    return out[:, None] * m


def reinforce(r, m, gamma):
    """ROLL's reinforce without normalisation: the unwhitened returns of `reinforce_pp`."""
    ret = reinforce_pp(r, m, gamma)[1]
    return ret * m, ret


def reinforce_pp(r, m, gamma):
    b, t = r.shape
    ret = np.zeros((b, t))
    for i in range(b):
        run = 0.0
        for j in reversed(range(t)):
            run = r[i, j] + gamma * run
            ret[i, j] = run
            if m[i, j] == 0:
                run = 0.0
    return whiten(ret, m) * m, ret


def reinforce_pp_baseline(r, m, ids):
    s = r.sum(-1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        out[rows] = s[rows] - (0.0 if len(rows) == 1 else s[rows].mean())
    tiled = out[:, None] * m
    return whiten(tiled, m) * m


def remax(r, m, base):
    ret = np.cumsum((r * m)[:, ::-1], axis=-1)[:, ::-1]
    return ret - base[:, None] * m, ret


def gpg(r, m, ids, f_norm=1.0):
    """veRL's compute_gpg_outcome_advantage: alpha * (s - group mean) / f_norm (singleton mean 0)."""
    s = r.sum(-1)
    alpha = len(s) / max(np.count_nonzero(s), 1)
    out = np.zeros_like(s)
    for rows in groups(ids).values():
        out[rows] = alpha * (s[rows] - (0.0 if len(rows) == 1 else s[rows].mean())) / f_norm
    return out[:, None] * m


def agg(loss, m, mode, num_tokens=None, num_seqs=None, scale=None):
    rows = [i for i in range(m.shape[0]) if m[i].sum() > 0]
    if mode == "token-mean":
        return (loss * m).sum() / (m.sum() if num_tokens is None else num_tokens)
    if mode == "seq-mean-token-sum":
        return sum((loss[i] * m[i]).sum() for i in rows) / (len(rows) if num_seqs is None else num_seqs)
    if mode == "seq-mean-token-mean":
        tot = sum((loss[i] * m[i]).sum() / (m[i].sum() + 1e-8) for i in rows)
        return tot / (len(rows) if num_seqs is None else num_seqs)
    return (loss * m).sum() / (m.shape[1] if scale is None else scale)


def ppo(old, lp, adv, m, mode, lo=0.2, hi=0.2, c=3.0, w=None):
    lr = np.clip(lp - old, -20, 20)
    r = np.exp(lr)
    l1, l2 = -adv * r, -adv * np.clip(r, 1 - lo, 1 + hi)
    cl1 = np.maximum(l1, l2)
    l3 = -adv * c
    loss = np.where(adv < 0, np.minimum(l3, cl1), cl1)
    if w is not None:
        loss = loss * w
    return agg(loss, m, mode), mmean((l2 > l1).astype(float), m), mmean(-lr, m), \
        mmean(((cl1 > l3) & (adv < 0)).astype(float), m)
