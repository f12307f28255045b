"""A small, obviously-correct numpy (float64) reference of the djax generation spec (the
README's generation options, the decoders' and cache policies' docstrings): the LLaDA dense
forward read straight from the HF tensors, every cache policy with explicitly variable-length
inputs, every deterministic decoder written row by row, early stop and iteration smoothing.
Rows are unpadded, each at its own offsets; all rows advance in lockstep, block by block,
step by step, as the spec says; iteration smoothing counts each row's own steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class RefLLaDA:
    """LLaDA dense forward in numpy from an HF folder (torch `[out, in]` tensors)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        self.t = {}
        for f in sorted(folder.glob("*.safetensors")):
            self.t.update({k: v.astype(np.float64) for k, v in load_file(str(f)).items()})
        self.n_layers, self.n_heads = cfg["n_layers"], cfg["n_heads"]
        self.n_kv = cfg["n_kv_heads"]
        self.head_dim = cfg["d_model"] // self.n_heads
        self.theta, self.eps = cfg["rope_theta"], cfg["rms_norm_eps"]
        self.emb = self.t["model.transformer.wte.weight"]

    def w(self, name: str) -> np.ndarray:
        return self.t[f"model.transformer.{name}.weight"]

    def norm(self, x, name):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.eps) * self.w(name)

    def rope(self, x, pos):  # x [t, heads, d]
        d = x.shape[-1]
        inv = 1.0 / self.theta ** (np.arange(0, d, 2) / d)
        ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
        rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    def forward(self, inputs: np.ndarray, lo: int, seq: int, cache, allowed=None):
        """inputs: [t, model] embeddings of positions [lo, lo + t) of a sequence of `seq`.
        cache: per layer (K, V) [seq, kv, d] or None. Fresh K/V of the fed positions replace
        the cache's; every query attends to all `seq` positions, or with `allowed` (per
        layer a bool [kv, seq]) the queries of each kv head's group to its allowed keys only.
        Returns logits [t, vocab] and the cache with the fed positions written."""
        x, t = inputs, inputs.shape[0]
        pos = np.arange(lo, lo + t, dtype=np.float64)
        new_cache = []
        group = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            b = f"blocks.{i}"
            h = self.norm(x, f"{b}.attn_norm")
            q = (h @ self.w(f"{b}.q_proj").T).reshape(t, self.n_heads, self.head_dim)
            k = (h @ self.w(f"{b}.k_proj").T).reshape(t, self.n_kv, self.head_dim)
            v = (h @ self.w(f"{b}.v_proj").T).reshape(t, self.n_kv, self.head_dim)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if cache is None:
                assert lo == 0 and t == seq
                keys, values = k, v
            else:
                keys, values = cache[i][0].copy(), cache[i][1].copy()
                keys[lo : lo + t], values[lo : lo + t] = k, v
            new_cache.append((keys, values))
            kh = np.repeat(keys, group, axis=1)
            vh = np.repeat(values, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, kh) / np.sqrt(self.head_dim)
            if allowed is not None:
                keep = np.repeat(allowed[i], group, axis=0)[:, None, :]
                scores = np.where(keep, scores, -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            att = np.einsum("hts,shd->thd", probs, vh).reshape(t, -1)
            x = x + att @ self.w(f"{b}.attn_out").T
            h = self.norm(x, f"{b}.ff_norm")
            gate, up = h @ self.w(f"{b}.ff_proj").T, h @ self.w(f"{b}.up_proj").T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w(f"{b}.ff_out").T
        logits = self.norm(x, "ln_f") @ self.t["model.transformer.ff_out.weight"].T
        return logits, new_cache


def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def commit_rows(
    rule: str,
    conf: np.ndarray,
    masked: np.ndarray,
    *,
    k: int = 0,
    tau: float = 0.9,
    low: float = 0.4,
    factor: float = 1.0,
) -> np.ndarray:
    """One row's commit mask, written as plainly as the spec reads."""
    idx = [int(i) for i in np.flatnonzero(masked)]
    commit = np.zeros(masked.shape, bool)
    if not idx:
        return commit
    by_conf = sorted(idx, key=lambda i: (-conf[i], i))
    if rule == "low_confidence":
        commit[by_conf[:k]] = True
    elif rule in ("threshold", "credit"):
        chosen = [i for i in idx if conf[i] >= tau]
        commit[chosen or by_conf[:1]] = True
    elif rule == "factor":
        n = 0
        while n < len(by_conf) and (n + 2) * (1 - conf[by_conf[n]]) < factor:
            n += 1
        commit[by_conf[: max(n, 1)]] = True
    elif rule == "hierarchy":
        runs, current = [], []
        for i in range(len(masked)):
            if masked[i]:
                current.append(i)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        for run in runs:
            best = sorted(run, key=lambda i: (-conf[i], i))[0]
            if conf[best] > low:
                commit[best] = True
        for i in idx:
            if conf[i] > tau:
                commit[i] = True
        commit[by_conf[0]] = True
    else:
        raise ValueError(rule)
    return commit


def reference_generate(
    model: RefLLaDA,
    prompts: list[list[int]],
    *,
    gen_length: int,
    block: int,
    decoder: str,
    cache: str,
    mask_id: int,
    eos_id: int,
    stop_ids: tuple[int, ...],
    steps: int | None = None,
    tau: float = 0.9,
    low: float = 0.4,
    factor: float = 1.0,
    refresh_every: int = 0,
    before: int = 16,
    after: int = 16,
    warmup: int = 4,
    alpha: float = 0.7,
    gamma: float = 0.2,
    beta: float = 0.8,
    smoothing: bool = False,
    early_stop: bool = True,
):
    """Returns (answers [rows, gen_length], forwards, refreshes)."""
    rows = len(prompts)
    seqs = [np.array(list(p) + [mask_id] * gen_length) for p in prompts]
    caches = [None] * rows
    n_blocks = gen_length // block
    per_block = (steps or gen_length) // n_blocks
    stopped = [False] * rows
    t = forwards = refreshes = 0
    # each row's steps as it would take them alone (every block's first step, then those
    # its block held masks): smoothing's weight and threshold follow them, not the batch's
    row_t = [0] * rows
    for b in range(n_blocks):
        if early_stop and all(stopped):
            break
        starts = [len(p) + b * block for p in prompts]
        masks_at_start = [
            int(np.sum(s[st : st + block] == mask_id)) for s, st in zip(seqs, starts, strict=True)
        ]
        credit = [np.zeros((block, model.emb.shape[0])) for _ in range(rows)]
        soft = [np.zeros((block, model.emb.shape[1])) for _ in range(rows)]
        j = 0
        while j == 0 or any(
            np.any(s[st : st + block] == mask_id) for s, st in zip(seqs, starts, strict=True)
        ):
            refresh = (
                j == 0
                or cache == "none"
                or (refresh_every and j % refresh_every == 0)
                or (cache == "vicinity" and t < warmup)
            )
            forwards += 1
            refreshes += int(refresh)
            for r in range(rows):
                seq, st = seqs[r], starts[r]
                size = len(seq)
                if refresh:
                    lo, hi = 0, size
                elif cache == "dual":
                    lo, hi = st, st + block
                elif cache == "prefix":
                    lo, hi = st, size
                else:
                    lo, hi = max(st - before, 0), min(st + block + after, size)
                x = model.emb[seq[lo:hi]].copy()
                masked = seq[st : st + block] == mask_id
                if smoothing:
                    w = min(0.15 + 0.02 * row_t[r], 0.3)
                    for i in np.flatnonzero(masked):
                        x[st - lo + i] += w * soft[r][i]
                logits, new_cache = model.forward(x, lo, size, None if refresh else caches[r])
                if cache != "none":
                    caches[r] = new_cache
                z = logits[st - lo : st - lo + block]
                if decoder == "credit":
                    if j > 0:
                        credit[r] *= beta
                    p = softmax(z)
                    for i in np.flatnonzero(masked):
                        credit[r][i, np.argmax(p[i])] += p[i].max() ** gamma
                    z_dec = z + alpha * np.log1p(credit[r])
                else:
                    z_dec = z
                chosen = z_dec.copy()
                chosen[:, mask_id] = -np.inf
                token = chosen.argmax(-1)
                conf = softmax(z_dec)[np.arange(block), token]
                step_tau = max(1 - 0.02 * row_t[r], tau) if smoothing else tau
                m = masks_at_start[r]
                k = m // per_block + int(j < m % per_block)
                commit = commit_rows(
                    decoder, conf, masked, k=k, tau=step_tau, low=low, factor=factor
                )
                seq[st : st + block] = np.where(commit, token, seq[st : st + block])
                if smoothing:
                    soft[r] = softmax(z) @ model.emb
                row_t[r] += int(j == 0 or masked.any())
            t += 1
            j += 1
        for r in range(rows):
            st = starts[r]
            if early_stop and np.any(np.isin(seqs[r][st : st + block], stop_ids)):
                seqs[r][st + block :] = eos_id
                stopped[r] = True
    answers = np.stack([s[len(p) :] for s, p in zip(seqs, prompts, strict=True)])
    return answers, forwards, refreshes
