"""Token-by-token decoding of a small NNX transformer with a KV cache.

    python examples/decode.py            # 256 tokens, fastcall.jit vs nnx.jit
    python examples/decode.py --steps 32 --dim 64

Each step embeds the last token, attends over the cached keys and values
(nnx.Cache variables, updated in place inside the compiled step and written
back by fastcall), and picks the next token greedily. Both call paths start
from the same weights and must produce the same tokens and the same cache.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fastcall


class Block(nnx.Module):
    """Pre-norm attention (one head) over a KV cache, then an MLP."""

    def __init__(self, dim: int, max_len: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.q = nnx.Linear(dim, dim, rngs=rngs)
        self.k = nnx.Linear(dim, dim, rngs=rngs)
        self.v = nnx.Linear(dim, dim, rngs=rngs)
        self.o = nnx.Linear(dim, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.k_cache = nnx.Cache(jnp.zeros((max_len, dim)))
        self.v_cache = nnx.Cache(jnp.zeros((max_len, dim)))

    def __call__(self, h, index):
        x = self.norm1(h)
        self.k_cache[...] = jax.lax.dynamic_update_slice(self.k_cache[...], self.k(x)[None], (index, 0))
        self.v_cache[...] = jax.lax.dynamic_update_slice(self.v_cache[...], self.v(x)[None], (index, 0))
        scores = self.k_cache[...] @ self.q(x) / jnp.sqrt(x.shape[-1])
        scores = jnp.where(jnp.arange(scores.shape[0]) <= index, scores, -jnp.inf)
        h = h + self.o(jax.nn.softmax(scores) @ self.v_cache[...])
        return h + self.down(nnx.gelu(self.up(self.norm2(h))))


class Decoder(nnx.Module):
    def __init__(self, vocab: int, dim: int, layers: int, max_len: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, max_len, rngs) for _ in range(layers)])
        self.head = nnx.Linear(dim, vocab, rngs=rngs)
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(self, token):
        h = self.embed(token)
        i = self.index[...]
        for block in self.blocks:
            h = block(h, i)
        self.index[...] = i + 1
        return jnp.argmax(self.head(h)).astype(jnp.int32)


def step(model, token):
    return model(token)


def decode(call, model, steps: int) -> tuple[list[int], float]:
    token = jnp.asarray(1, jnp.int32)
    token = call(model, token)  # compile outside the timing
    jax.block_until_ready(token)
    tokens = []
    t0 = time.perf_counter()
    for _ in range(steps):
        token = call(model, token)
        tokens.append(token)
    jax.block_until_ready(token)
    elapsed = time.perf_counter() - t0
    return [int(t) for t in tokens], steps / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    max_len = args.steps + 1

    def build():
        return Decoder(args.vocab, args.dim, args.layers, max_len, nnx.Rngs(0))

    results = {}
    models = {}
    for name, call in (("fastcall.jit", fastcall.jit(step)), ("nnx.jit", nnx.jit(step))):
        models[name] = build()
        results[name] = decode(call, models[name], args.steps)
    (a, rate_a), (b, rate_b) = results["fastcall.jit"], results["nnx.jit"]
    assert a == b, "the two call paths produced different tokens"
    for x, y in zip(jax.tree_util.tree_leaves(nnx.state(models["fastcall.jit"], nnx.Cache)),
                    jax.tree_util.tree_leaves(nnx.state(models["nnx.jit"], nnx.Cache))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    print(f"{args.steps} tokens, same tokens and same KV cache from both call paths")
    print(f"first tokens: {a[:16]}")
    print(f"fastcall.jit: {rate_a:8.0f} tokens/s")
    print(f"nnx.jit:      {rate_b:8.0f} tokens/s   (fastcall.jit: {rate_a / rate_b:.1f}x the tokens per second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
