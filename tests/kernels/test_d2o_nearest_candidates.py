"""D2O's one-in-one-out step with the decode attention's nearest keys (``nearest`` state, kvpass/kernels/
decode_attention_nearest.py): over a chain of steps (eviction, then the step's write and attention, then its
scores), the Triton step given the attention's results ends every step as the plain step does, whether its
evicted entry was one of the candidates (it takes the attention's result) or not (it scans); the candidates it
names for the next step are the lowest-score entries the next step may evict."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvpass.kernels.d2o_evict_one import (
    d2o_evict_one_reference,
    d2o_evict_one_triton,
    next_candidates,
    pick_one,
)
from kvpass.kernels.d2o_evict_one_ragged import d2o_evict_one_ragged_reference, d2o_evict_one_ragged_triton
from kvpass.kernels.decode_attention_nearest import (
    decode_attention_nearest_triton,
    nearest_of_candidates_reference,
)
from tests.kernels.test_d2o_evict_one import assert_same, copied, decode_write, random_layer
from tests.kernels.test_d2o_evict_ragged import NEVER, ragged_layer, row_split

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# the module, not the op of the same name that kvpass.kernels exports
nearest_module = importlib.import_module("kvpass.kernels.decode_attention_nearest")

KEEP, SINKS, RECENT = 24, 2, 3
NEXT, FROM, INV_NORM, CAND, BEST, SLOT = range(6)


@pytest.fixture(autouse=True)
def fuse_at_every_batch(monkeypatch):
    """These cases have batch 2; the op fuses from FUSE_FROM_BATCH on (a speed choice, not a semantic one)."""
    monkeypatch.setattr(nearest_module, "FUSE_FROM_BATCH", 1)


def nearest_state(b: int, h: int, m: int = 4, device: str = "cpu", c: int = KEEP + 1) -> list[torch.Tensor]:
    none = torch.full((b, h, m), -1, dtype=torch.long, device=device)
    return [none, torch.zeros(b, h, dtype=torch.long, device=device),
            torch.full((b, h, c), float("nan"), device=device), none.clone(),
            torch.full((b, h, m), float("-inf"), device=device), torch.zeros_like(none)]


def assert_norms_kept(layer: dict[str, torch.Tensor], state: list[torch.Tensor]) -> None:
    """Where the step named candidates, the kept inverse norms are those of the row's live keys now (fp32
    rounding), and the emptied slot's is unknown (NaN)."""
    named = (state[NEXT] >= 0).any(-1).cpu()
    inv = state[INV_NORM].cpu()
    k = layer["k"].cpu().double()
    live = torch.arange(k.shape[2]) < layer["length"].cpu()[..., None]
    want = 1 / k.norm(dim=-1).clamp(min=1e-12)
    check = named[..., None] & live
    assert named.any()
    torch.testing.assert_close(inv[check].double(), want[check], rtol=2e-6, atol=0)
    assert torch.isnan(inv[..., -1][named]).all()


def full_layer(seed: int, dtype: torch.dtype = torch.float32, near: float = 0.3) -> dict[str, torch.Tensor]:
    """Two batch rows of three heads, every row full (each step evicts), distinct scores (no ties); ``near``: the
    fraction of keys that are near copies of others (``random_layer``). Where the Triton attention's cosines
    feed the step, 0: its tensor-core dot rounds otherwise than the scan's sum, which may turn a near tie."""
    layer = random_layer(2, 3, KEEP, 16, seed=seed, dtype=dtype, length=torch.full((2, 3), KEEP + 1), near=near)
    gen = torch.Generator().manual_seed(seed)
    layer["col_sum"] = torch.rand(2, 3, KEEP + 1, generator=gen)
    return layer


def write_and_score(layer: dict[str, torch.Tensor], gen: torch.Generator, nearest: list[torch.Tensor] | None,
                    drift: float) -> None:
    """The decode step after the eviction: a new entry at slot length (newest position), its attention (the
    nearest keys of the named candidates, where ``nearest``), then small positive scores added to every live
    entry (``drift`` their size: small keeps the next evicted entry among the candidates)."""
    b, h, c, d = layer["k"].shape
    slot = layer["length"][..., None]
    for name in ("k", "v"):
        t = layer[name]
        t.scatter_(2, slot[..., None].expand(-1, -1, 1, d), torch.randn(b, h, 1, d, generator=gen).to(t.device, t.dtype))
    layer["position"].scatter_(2, slot, layer["position"].amax(-1, keepdim=True) + 1)
    layer["log_weight"].scatter_(2, slot, 0.0)
    layer["col_sum"].scatter_(2, slot, 0.0)
    layer["window"].scatter_(2, slot, 0.5)
    layer["length"].add_(1)
    if nearest is not None:
        best, near = nearest_of_candidates_reference(layer["k"].cpu(), layer["log_weight"].cpu(), nearest[0].cpu(),
                                                     nearest[1].cpu())
        nearest[CAND].copy_(nearest[NEXT])
        nearest[BEST].copy_(best)
        nearest[SLOT].copy_(near)
    live = layer["log_weight"] > float("-inf")
    layer["col_sum"] += torch.where(live, drift * torch.rand(b, h, c, generator=gen).to(live.device), 0.0)


def in_candidates(layer: dict[str, torch.Tensor], nearest: list[torch.Tensor]) -> torch.Tensor:
    """[B, Hkv] bool: whether this step's evicted entry is one the attention searched for."""
    e = pick_one(layer["k"].cpu(), layer["v"].cpu(), layer["col_sum"].cpu(), layer["position"].cpu(),
                 layer["length"].cpu(), KEEP, SINKS, RECENT).e
    return (nearest[CAND].cpu() == e).any(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_steps_with_the_attentions_nearest_keys_equal_the_plain_step(dtype, splits, triton_device):
    """A chain of steps on the plain step's results (each step's Triton run from the same inputs: bf16 merges may
    differ in the last bit, which would compound), the candidates the Triton step names carried to the next."""
    layer = full_layer(seed=splits, dtype=dtype)
    state = nearest_state(2, 3)
    gen = torch.Generator().manual_seed(7)
    hits = misses = 0
    for step in range(8):
        known = in_candidates(layer, state)
        hits, misses = hits + int(known.sum()), misses + int((~known).sum())
        want, got = copied(layer, "cpu"), copied(layer, triton_device)
        got_state = [t.to(triton_device, copy=True) for t in state]
        d2o_evict_one_reference(*_args(want, []))
        d2o_evict_one_triton(*_args(got, got_state), splits=splits, block_c=4, block_scan=8)
        assert_same(got, want, f"step {step}")
        assert_norms_kept(got, got_state)
        layer, state = want, [t.cpu() for t in got_state]
        known = ~torch.isnan(state[INV_NORM])          # the chain goes on from the plain step's K: its bf16 merges
        state[INV_NORM][known] = (1 / layer["k"].double().norm(dim=-1).clamp(min=1e-12)).float()[known]   # may differ
        write_and_score(layer, gen, state, drift=0.02 if step % 4 else 1.0)    # step 4k: large, the order changes
    assert hits > 0 and misses > 0, (hits, misses)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_named_candidates_are_the_lowest_the_next_step_may_evict(splits, triton_device):
    layer = full_layer(seed=5)
    state = nearest_state(2, 3, device=triton_device)
    before = copied(layer, "cpu")
    e = pick_one(before["k"], before["v"], before["col_sum"], before["position"], before["length"], KEEP, SINKS,
                 RECENT).e
    want = next_candidates(before["col_sum"], before["position"], before["length"], e, KEEP, SINKS, RECENT, 4)
    got = copied(layer, triton_device)
    d2o_evict_one_triton(*_args(got, state), splits=splits, block_c=4, block_scan=8)
    score = got["col_sum"].cpu()                                   # after the step's move: slot e holds the newest
    named = state[NEXT].cpu()
    assert (named >= 0).all() and (named.sort(-1).values.diff(dim=-1) > 0).all()          # four distinct slots
    assert torch.equal(score.gather(2, named).sort(-1).values, score.gather(2, want).sort(-1).values)
    assert (state[FROM].cpu() == 0).all()                           # target_from of the step
    ref = nearest_state(2, 3)
    d2o_evict_one_reference(*_args(copied(layer, "cpu"), ref))
    assert torch.equal(ref[NEXT], want)


def test_the_step_takes_the_attentions_result_where_its_entry_was_searched(triton_device):
    """A false result (cosine 1 to slot 0) for the evicted entry changes the merge: the step read it rather than
    scan. The same false result for another slot changes nothing: the step scanned."""
    layer = full_layer(seed=9)
    e = pick_one(layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["length"], KEEP, SINKS,
                 RECENT).e[..., 0]
    want = copied(layer, triton_device)                               # the Triton step that scans: bit for bit
    d2o_evict_one_triton(*_args(want, []), splits=2, block_c=4, block_scan=8)
    for searched, changes in ((e, True), ((e + 1) % KEEP, False)):
        state = nearest_state(2, 3)
        state[CAND][..., 0] = searched
        state[BEST][..., 0] = 1.0
        state[SLOT][..., 0] = 0
        got = copied(layer, triton_device)
        d2o_evict_one_triton(*_args(got, [t.to(triton_device) for t in state]), splits=2, block_c=4, block_scan=8)
        assert torch.equal(got["k"], want["k"]) != changes, changes


def test_the_fused_attention_and_step_over_steps(triton_device):
    """The Triton attention's results (not the reference's) feed the Triton step: every step as the plain one."""
    want = full_layer(seed=11, near=0.0)
    got = copied(want, triton_device)
    state = nearest_state(2, 3, device=triton_device)
    gen_w, gen_g = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(5):
        d2o_evict_one_reference(*_args(want, []))
        d2o_evict_one_triton(*_args(got, state), splits=2, block_c=4, block_scan=8)
        assert_same(got, want, f"step {step}")
        assert_norms_kept(got, state)
        write_and_score(want, gen_w, None, drift=0.02)
        write_and_score(got, gen_g, None, drift=0.02)
        q = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(step)).to(triton_device)
        decode_attention_nearest_triton(q, got["k"], got["v"], got["log_weight"], *state, 0.25, None, False,
                                        num_splits=2, block_n=16)
    assert (state[CAND] >= 0).all()


def test_the_newest_entry_the_attention_leaves_out_is_compared_by_the_step(triton_device):
    """The newest entry's norm is not known to the attention (NaN): where it is the evicted entry's nearest key,
    the step finds it itself, and merges as the plain step does."""
    want = full_layer(seed=13, near=0.0)
    got = copied(want, triton_device)
    state = nearest_state(2, 3, device=triton_device)
    d2o_evict_one_reference(*_args(want, []))
    d2o_evict_one_triton(*_args(got, state), splits=2, block_c=4, block_scan=8)
    assert_same(got, want, "first step")
    e_next = state[NEXT][..., 0].cpu()                              # the lowest the next step may evict
    noise = 1e-3 * torch.randn(2, 3, 1, 16, generator=torch.Generator().manual_seed(3))
    for layer in (want, got):                                       # its near copy as the newest entry
        write_and_score(layer, torch.Generator().manual_seed(3), None, drift=0.0)
        k = layer["k"]
        src = k.gather(2, e_next.to(k.device)[..., None, None].expand(-1, -1, 1, k.shape[3]))
        k[:, :, -1:] = (src.float() + noise.to(k.device)).to(k.dtype)
    q = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(4)).to(triton_device)
    decode_attention_nearest_triton(q, got["k"], got["v"], got["log_weight"], *state, 0.25, None, False,
                                    num_splits=2, block_n=16)
    e = pick_one(want["k"], want["v"], want["col_sum"], want["position"], want["length"], KEEP, SINKS, RECENT).e
    assert torch.equal(e[..., 0], e_next) and (state[CAND][..., 0].cpu() == e_next).all()       # every row a hit
    assert (state[SLOT][..., 0].cpu() != KEEP).all()                # the attention left the newest out
    nearest = pick_one(want["k"], want["v"], want["col_sum"], want["position"], want["length"], KEEP, SINKS,
                       RECENT).nearest[..., 0]
    assert (nearest == KEEP).all()                                  # ... which is e's nearest key
    d2o_evict_one_reference(*_args(want, []))
    d2o_evict_one_triton(*_args(got, state), splits=2, block_c=4, block_scan=8)
    assert_same(got, want, "the step after")
    assert_norms_kept(got, state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_rows_with_the_attentions_nearest_keys_equal_the_plain_step(dtype, triton_device):
    """Rows of their own budgets (``d2o_evict_one_ragged``, one row never evicting): the Triton op given the
    Triton attention's results ends every step as the plain-torch ragged step does, and takes those results."""
    keeps = [KEEP, 17, 21, NEVER]
    want = ragged_layer(keeps, 3, 16, seed=2, dtype=dtype, capacity=KEEP + 1, near=0.0)
    split = row_split(keeps, SINKS)
    state = nearest_state(4, 3, device=triton_device)
    gen = torch.Generator().manual_seed(5)
    hits = 0
    for step in range(8):
        got = copied(want, triton_device)
        e = pick_one(want["k"], want["v"], want["col_sum"], want["position"], want["length"], split[0], split[1],
                     split[2]).e[..., 0]
        hits += int(((state[CAND].cpu() == e[..., None]).any(-1) & (want["length"] > split[0][:, None])).sum())
        d2o_evict_one_ragged_reference(*_args(want, [])[:9], *split, 0.7, "paper")
        d2o_evict_one_ragged_triton(*_args(got, [])[:9], *(t.to(triton_device) for t in split), 0.7, "paper",
                                    nearest=state, splits=2, block_c=4, block_scan=8)
        assert_same(got, want, f"step {step}")
        known = ~torch.isnan(state[INV_NORM])             # on from the plain step's K (bf16 merges: last bits)
        state[INV_NORM][known] = (1 / want["k"].double().norm(dim=-1).clamp(min=1e-12)).float().to(
            triton_device)[known]
        decode_write(want, step, gen)
        for_attention = copied(want, triton_device)
        q = torch.randn(4, 6, 1, 16, generator=torch.Generator().manual_seed(step)).to(triton_device, dtype)
        decode_attention_nearest_triton(q, for_attention["k"], for_attention["v"], for_attention["log_weight"], *state,
                                        0.25, None, False, num_splits=2, block_n=16)
    assert hits > 0


def _args(layer: dict[str, torch.Tensor], nearest: list[torch.Tensor]) -> tuple:
    return (layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
            layer["tau"], layer["tau_set"], [layer["window"]], nearest, KEEP, SINKS, RECENT, 0.7, "paper")
