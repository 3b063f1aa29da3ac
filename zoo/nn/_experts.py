"""A sparse mixture-of-experts feed-forward layer: a top-k router and stacked experts."""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._axes import field
from ._dropout import ExampleKeys
from ._feedforward import silu
from ._linear import Linear, flatten_rows
from ._sharding import entries, for_use, sharding_spec

Dispatch = Literal["dense", "sorted"]
DISPATCHES = ("dense", "sorted")


class ExpertLinear(eqx.Module):
    """`num_experts` bias-free projections stacked on a leading logical `"expert"` axis:
    weight `[experts, in, out]` (each expert's slice stored `[in, out]`, as `Linear`)."""

    weight: Float[Array, "experts in_features out_features"] = field(
        axes=lambda self: ("expert", self.in_axis, self.out_axis)
    )
    in_axis: str | None = eqx.field(static=True)
    out_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        in_axis: str | None = "embed",
        out_axis: str | None = "mlp",
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:** `num_experts`, each expert's `in_features` and `out_features`, the
        logical axes of those two dimensions, normal `init_std`, PRNG `key`."""
        self.weight = init_std * jr.normal(key, (num_experts, in_features, out_features))
        self.in_axis = in_axis
        self.out_axis = out_axis

    def spread(self, rows: Float[Array, "*batch in"], lead: int) -> Float[Array, "*batch experts out"]:
        """Every expert's projection of every row of `rows` (`lead` batch dimensions),
        in `rows`' dtype: `[*batch, experts, out]`."""
        weight = for_use(self.weight, rows, lead_ndim=lead).astype(rows.dtype)
        spec = _spec(rows, lead, (entries(weight)[0], entries(weight)[2]))
        return jnp.einsum("...d,edi->...ei", rows, weight, out_sharding=spec)

    def gather(self, h: Float[Array, "*batch experts in"], lead: int) -> Float[Array, "*batch out"]:
        """Each expert's projection of its own slice of `h` (`[*batch, experts, in]`),
        summed over the experts: `[*batch, out]`."""
        weight = for_use(self.weight, h, lead_ndim=lead).astype(h.dtype)
        return jnp.einsum("...ei,eid->...d", h, weight, out_sharding=_spec(h, lead, (entries(weight)[2],)))

    def stacked(self, dtype: Any) -> Float[Array, "experts in_features out_features"]:
        """The weight the experts compute with, in `dtype` (one device: `Experts`' sorted dispatch)."""
        return self.weight.astype(dtype)


class RouterChoice(eqx.Module):
    """What a router chose for each token: the softmax over every expert (`probs`,
    float32) and how many of its top-k slots each expert took (`chosen`, 0 or 1)."""

    probs: Float[Array, "*batch experts"]
    chosen: Float[Array, "*batch experts"]


class Experts(eqx.Module):
    """A sparse mixture-of-experts SwiGLU feed-forward layer (Mixtral's, Qwen3-MoE's).

    Each token's router logits (`router`, `embed → experts`, float32) go through a softmax
    over every expert; its `top_k` largest probabilities pick its experts and weight their
    outputs, renormalised to sum to 1 when `normalize` (Mixtral; Qwen3-MoE's
    `norm_topk_prob`). Expert `e` is `down_e(silu(gate_e(x)) * up_e(x))`, its weights the
    `e`-th slices of `gate`, `up`, `down` (logical axes `("expert", "embed", "mlp")` and
    `("expert", "mlp", "embed")`).

    Token dispatch (`dispatch`):

    - `"dense"` (default): every expert runs on every token, its output weighted by the
      router's sparse weights (zero outside the token's top-k), the sum over experts folded
      into the down projection's contraction. Every op is an einsum over the global-view
      batch, so no preset adds a collective (the batch stays where it is: no sort or
      gather across devices) and reduced parameters work as in `FeedForward`; it costs
      `num_experts / top_k` times the feed-forward FLOPs of the sparse computation.
    - `"sorted"`: the token-expert pairs sorted by expert and run through
      `jax.lax.ragged_dot` (grouped matmuls), then scattered back: the sparse FLOPs.
      Single-device only (sorting a batch split over devices would move it between
      them); refused under a mesh. On XLA's CPU backend it measured slower than dense at 8
      experts top-2 (benchmarks/moe_dispatch.py).
    """

    router: Linear
    # Each an `ExpertLinear`, or one carrying a LoRA branch (`zoo.lora`, peft's
    # `target_parameters`), which computes the same three methods.
    gate: ExpertLinear
    up: ExpertLinear
    down: ExpertLinear
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    normalize: bool = eqx.field(static=True)
    dispatch: str = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        normalize: bool = True,
        dispatch: Dispatch = "dense",
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:** model width `dim`, each expert's `hidden_dim`, `num_experts`,
        `top_k` experts per token, whether the top-k weights are renormalised
        (`normalize`), the token `dispatch` (`"dense"` or `"sorted"`), normal `init_std`,
        PRNG `key`."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"Experts: top_k={top_k} must be between 1 and num_experts={num_experts}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"Experts: dispatch={dispatch!r}; use one of {list(DISPATCHES)}")
        kr, kg, ku, kd = jr.split(key, 4)
        self.router = Linear(
            dim, num_experts, use_bias=False, in_axis="embed", out_axis=None, init_std=init_std, key=kr
        )
        self.gate = ExpertLinear(num_experts, dim, hidden_dim, init_std=init_std, key=kg)
        self.up = ExpertLinear(num_experts, dim, hidden_dim, init_std=init_std, key=ku)
        self.down = ExpertLinear(
            num_experts, hidden_dim, dim, in_axis="mlp", out_axis="embed", init_std=init_std, key=kd
        )
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize = normalize
        self.dispatch = dispatch

    def route(self, x: Float[Array, "*batch embed"]) -> tuple[Float[Array, "*batch {self.num_experts}"], RouterChoice]:
        """The router's sparse weights of `x` (each token's top-k weights at its experts,
        zero elsewhere; float32) and its `RouterChoice`."""
        logits = self.router(x.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        chosen = top_k_mask(lax.stop_gradient(probs), self.top_k)
        # The weights are the probabilities masked to the choice, differentiated as
        # transformers' top-k values are (the choice itself is not).
        weights = probs * chosen
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, RouterChoice(probs=probs, chosen=chosen)

    def __call__(
        self, x: Float[Array, "*batch embed"], *, key: ExampleKeys | None = None, choice: bool = False
    ) -> Float[Array, "*batch embed"] | tuple[Float[Array, "*batch embed"], RouterChoice]:
        """Apply the layer to the last axis of `x`. `key` is unused (accepted as
        `FeedForward`'s); with `choice`, returns `(output, RouterChoice)` (the load-balancing
        loss's inputs, `load_balancing_loss`)."""
        weights, chosen = self.route(x)
        run = self._sorted if self.dispatch == "sorted" else self._dense
        out = run(x, weights.astype(x.dtype))
        return (out, chosen) if choice else out

    def _dense(self, x: Array, weights: Array) -> Array:
        rows, restore = flatten_rows(x)
        lead = rows.ndim - 1
        g, u = self.gate.spread(rows, lead), self.up.spread(rows, lead)
        w = (
            weights
            if rows is x
            else weights.reshape(*rows.shape[:-1], self.num_experts, out_sharding=_spec(rows, lead, (None,)))
        )
        h = silu(g) * u * w[..., None]
        return restore(self.down.gather(h, lead))

    def _sorted(self, x: Array, weights: Array) -> Array:
        if sharding_spec(x) is not None:
            raise ValueError(
                "Experts(dispatch='sorted') runs on one device: sorting tokens split over a mesh would move them "
                "between devices. Use dispatch='dense' under a mesh (TransformerConfig.moe_dispatch='dense')."
            )
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        w = weights.reshape(-1, self.num_experts)
        top, index = lax.top_k(w, self.top_k)  # the router's choices again, from the sparse weights
        flat = index.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        xs = rows[order // self.top_k]
        dtype = x.dtype
        h = silu(lax.ragged_dot(xs, self.gate.stacked(dtype), sizes)) * lax.ragged_dot(
            xs, self.up.stacked(dtype), sizes
        )
        ys = lax.ragged_dot(h, self.down.stacked(dtype), sizes) * top.reshape(-1)[order][:, None]
        out = jnp.zeros_like(ys).at[order].set(ys).reshape(rows.shape[0], self.top_k, -1).sum(axis=1)
        return out.reshape(*lead, -1)


def top_k_mask(probs: Float[Array, "*batch experts"], k: int) -> Float[Array, "*batch experts"]:
    """1.0 at each row's `k` largest entries of `probs`, 0.0 elsewhere; of equal entries the
    lower index first (as `torch.topk` and `lax.top_k` pick).

    An entry's rank is the number of entries before it in that order: elementwise
    comparisons and a sum over the row (`[*batch, experts, experts]`), so a batch split
    over devices stays where it is; `lax.top_k` there all-gathered its input in every
    layer of a data-parallel step.
    """
    n = probs.shape[-1]
    ahead = jnp.arange(n)[:, None] < jnp.arange(n)[None, :]  # [j, e]: j comes before e among equals
    before = (probs[..., :, None] > probs[..., None, :]) | ((probs[..., :, None] == probs[..., None, :]) & ahead)
    rank = jnp.sum(before, axis=-2)
    return (rank < k).astype(probs.dtype)


def _spec(x: Array, lead: int, tail: tuple) -> jax.sharding.PartitionSpec | None:
    """The sharding of `x`'s leading `lead` dims followed by `tail` (None: no mesh)."""
    if sharding_spec(x) is None:
        return None
    return jax.sharding.PartitionSpec(*entries(x)[:lead], *tail)


def load_balancing_loss(
    probs: Float[Array, "layers *batch experts"],
    chosen: Float[Array, "layers *batch experts"],
    mask: Bool[Array, "*batch"] | None = None,
) -> Float[Array, ""]:
    """The router's load-balancing loss as transformers computes it
    (`load_balancing_loss_func`, Switch Transformer eqs. 4-6) over every layer's tokens.

    `num_experts · Σ_e f_e · P_e`, where over the tokens of every layer together (the real
    ones: `mask` `True`), `f_e` is the number of top-k slots expert `e` took per token and
    `P_e` its mean router probability. The training loss adds it times
    `router_aux_loss_coef`.

    **Arguments:** each layer's `RouterChoice` fields stacked (`probs`, `chosen`:
    `[layers, *batch, experts]`), the `mask` of real tokens (`None`: all).

    **Returns:** the float32 scalar loss.
    """
    num_experts = probs.shape[-1]
    weight = jnp.ones(probs.shape[:-1], jnp.float32) if mask is None else jnp.broadcast_to(mask, probs.shape[:-1])
    weight = weight.astype(jnp.float32)[..., None]
    rows = jnp.sum(weight)
    tokens_per_expert = jnp.sum(chosen * weight, axis=tuple(range(probs.ndim - 1))) / rows
    prob_per_expert = jnp.sum(probs * weight, axis=tuple(range(probs.ndim - 1))) / rows
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


def load_balancing_loss_per_device(
    probs: Float[Array, "layers batch seq experts"],
    chosen: Float[Array, "layers batch seq experts"],
    mask: Bool[Array, "batch seq"] | None = None,
) -> Float[Array, " batch"]:
    """`load_balancing_loss` of each device's rows, handed to each of those rows: what
    transformers computes per forward on each device under data parallelism.

    The rows of a batch split over mesh axes are taken in the groups that lie on one
    device (`[batch] → [devices, rows]`, a reshape that moves nothing); each group's
    statistics `f_e`, `P_e` are sums over its own rows, so no collective is needed, and
    its loss is handed back to each of its rows. Without a mesh, or inside `shard_map`,
    the whole batch is one group: `load_balancing_loss` of it. A group without a real
    token has loss 0.

    **Arguments:** the router's `probs` and `chosen` of every layer (`[layers, batch, seq,
    experts]`, `Transformer.with_router`), the `mask` of real tokens (`None`: all).

    **Returns:** `[batch]` float32, each row's group's loss.
    """
    layers, batch, _, num_experts = probs.shape
    weight = jnp.ones_like(probs[0, :, :, 0]) if mask is None else mask.astype(jnp.float32)
    tokens = jnp.einsum("lbse,bs->be", chosen, weight)
    mass = jnp.einsum("lbse,bs->be", probs, weight)
    rows = layers * jnp.sum(weight, axis=1)
    axes = entries(probs)[1]
    groups = 1
    if axes is not None:
        shape = jax.typeof(probs).sharding.mesh.shape
        for a in (axes,) if isinstance(axes, str) else axes:
            groups *= shape[a]

    def spec(*rest):
        return None if axes is None else jax.sharding.PartitionSpec(axes, *rest)

    def grouped(x):
        return jnp.sum(x.reshape(groups, batch // groups, *x.shape[1:], out_sharding=spec(*[None] * x.ndim)), 1)

    n = grouped(rows)
    n = jnp.where(n > 0, n, 1.0)
    loss = num_experts * jnp.sum((grouped(tokens) / n[:, None]) * (grouped(mass) / n[:, None]), axis=-1)
    per_row = lax.broadcast_in_dim(loss, (groups, batch // groups), (0,), out_sharding=spec(None))
    return per_row.reshape(batch, out_sharding=spec())
