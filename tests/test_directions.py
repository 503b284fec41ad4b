"""The counter-based direction generator: exact integer stream, kernel == plain torch bitwise, the distribution
(moments, tails, accuracy of the transform against float64 Box-Muller), the fused sums, and runs with it."""

import copy
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import LogisticRegression, VectorDataset, make_trainer

from zo_byzantine import counter, directions, native
from zo_byzantine.counter import GAMMA, MIX1, MIX2, counter_stream, counter_streams, mix
from zo_byzantine.directions import CounterDirections, TorchDirections, build_directions, direction_seed, tensor_seed
from zo_byzantine.ledger import replay
from zo_byzantine.perturbation import ParameterTable, apply_update

M64 = (1 << 64) - 1
needs_kernel = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                  reason="no C compiler: the compiled kernel cannot be built here")


def _python_mix(key: int, pair: int) -> int:
    x = (key + (pair + 1) * GAMMA) & M64
    x = ((x ^ (x >> 30)) * MIX1) & M64
    x = ((x ^ (x >> 27)) * MIX2) & M64
    return x ^ (x >> 31)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int64 if t.element_size() == 8
                               else torch.int16)


def test_integer_stream_is_exact_64_bit_arithmetic():
    """torch's wrapping int64 arithmetic gives SplitMix64 mod 2^64, as Python's integers compute it."""
    keys = [0, 1, (1 << 62) + 12345, (1 << 63) - 1, tensor_seed(direction_seed(1, 2, 3, 4), 7)]
    pairs = [0, 1, 2, 2**31 - 1, 2**32 + 5, 2**40, 2**62 - 1]
    for key in keys:
        got = mix(key, torch.tensor(pairs, dtype=torch.int64))
        assert [v & M64 for v in got.tolist()] == [_python_mix(key, p) for p in pairs]


@needs_kernel
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("numel", [1, 2, 3, 1001, native.MIN_PARALLEL + 3, 9 * native.MIN_PARALLEL + 1])  # threads
def test_compiled_kernel_equals_plain_torch_bitwise(distribution, numel):
    assert native.library() is not None
    gaussian = distribution == "gaussian"
    keys = [tensor_seed(direction_seed(5, t, 1, 0), 3) for t in range(3)]
    coeffs = [1e-3, -0.37, 2.5]
    z = torch.empty(numel)
    native.generate(z, keys[0], gaussian)
    assert torch.equal(_bits(z), _bits(counter_stream(keys[0], numel, distribution)))
    for dtype in (torch.float32, torch.float64):
        base = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=dtype)
        out = torch.empty_like(base)
        native.combine(base, out, keys, coeffs, gaussian)
        acc = None
        for key, c in zip(keys, coeffs, strict=True):
            term = counter_stream(key, numel, distribution).to(dtype) * c
            acc = term if acc is None else acc + term
        assert torch.equal(_bits(out), _bits(base + acc)), dtype
        native.combine(base, base, keys, coeffs, gaussian)  # in place
        assert torch.equal(_bits(base), _bits(out))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_path_of_the_generator_gives_the_same_bits(dtype, monkeypatch):
    """Fused kernel, kept directions (cached), gradient-carrying forward and plain torch agree, in every dtype."""
    gen = CounterDirections()
    param = torch.randn(3, 70001, generator=torch.Generator().manual_seed(0)).to(dtype)
    terms = [(direction_seed(1, 0, 1, r), c) for r, c in enumerate((1e-3, -2e-3))]
    fused = gen.perturb(param, 4, terms)
    kept = gen.perturb(param, 4, terms, cache={})
    with torch.enable_grad():
        tracked = gen.perturb(param.clone().requires_grad_(True), 4, terms)
    stepped = param.clone()
    gen.step_(stepped, 4, terms, lr=0.5)
    stepped_kept = param.clone()
    gen.step_(stepped_kept, 4, terms, lr=0.5, cache={})
    monkeypatch.setattr(native, "library", lambda: None)  # no kernel: the plain-torch path
    plain = gen.perturb(param, 4, terms)
    plain_step = param.clone()
    gen.step_(plain_step, 4, terms, lr=0.5)
    for other in (kept, tracked.detach(), plain):
        assert torch.equal(_bits(fused), _bits(other))
    assert torch.equal(_bits(stepped), _bits(stepped_kept)) and torch.equal(_bits(stepped), _bits(plain_step))
    assert tracked.grad_fn is not None
    assert not torch.equal(fused, param)


@needs_kernel
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_directions_drawn_together_are_each_direction_bitwise(distribution, monkeypatch):
    """``counter_streams`` (every key's pairs in the same operations, chunks ending inside a row) gives the
    kernel's stream of each key; ``draw_many`` and ``stacked_draws`` (kernel and plain path, some seeds cached)
    give ``draw`` of each seed; a sum whose directions are drawn in blocks of two gives the fused kernel's sum."""
    keys = [tensor_seed(direction_seed(4, t, 1, 0), 2) for t in range(5)]
    for numel in (1, 2, 7, 1000):
        expected = torch.empty(len(keys), numel)
        for row, key in zip(expected, keys, strict=True):
            native.generate(row, key, distribution == "gaussian")
        for chunk in (3, 1 << 19):
            monkeypatch.setattr(counter, "CHUNK_PAIRS", chunk)
            assert torch.equal(_bits(counter_streams(keys, numel, distribution)), _bits(expected)), (numel, chunk)
    gen = CounterDirections(distribution)
    param = torch.randn(3, 333, generator=torch.Generator().manual_seed(2))
    seeds = [direction_seed(4, 0, 1, r) for r in range(4)]
    terms = list(zip([*seeds, seeds[0]], (1e-3, -0.5, 2.0, 0.25, 1.5), strict=True))  # a seed twice
    reference = torch.stack([gen.draw(param, seed, 2) for seed in seeds])
    fused = gen.perturb(param, 2, terms)
    kernel = gen.draw_many(param, seeds, 2)
    monkeypatch.setattr(native, "library", lambda: None)  # the plain path from here
    monkeypatch.setattr(directions, "BLOCK_VALUES", 2 * param.numel())
    cache = {(seeds[1], 2): reference[1]}
    together = gen.stacked_draws(param.double(), 2, seeds, cache)
    assert together.dtype == torch.float64 and set(cache) == {(seed, 2) for seed in seeds}
    # kept directions own their memory (a cache pruned seed by seed frees it); a fresh block is not kept
    assert len({z.untyped_storage().data_ptr() for z in cache.values()}) == len(seeds)
    fresh = {}
    twice = gen.stacked_draws(param, 2, [seeds[2], seeds[0], seeds[2]], fresh)
    assert fresh == {} and torch.equal(_bits(twice), _bits(reference[[2, 0, 2]]))
    for other in (kernel, gen.draw_many(param, seeds, 2), together.float()):
        assert torch.equal(_bits(other), _bits(reference))
    assert torch.equal(_bits(gen.perturb(param, 2, terms)), _bits(fused))
    assert gen.stacked_draws(param, 2, []).shape == (0, 3, 333)


@pytest.mark.parametrize("generator", [CounterDirections(), CounterDirections("rademacher"), TorchDirections()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_of_a_sum_and_sums_into_kept_memory_are_the_same_bits(generator, dtype):
    """``perturb_rows`` (an embedding's rows only, from kept directions) is ``perturb(...)[rows]``, ``total``
    written into ``out`` is ``total`` and ``draw_rows`` (the counter stream at those elements only) is
    ``draw(...)[rows]``, bit for bit, for one term and several; rows repeated and out of order."""
    param = torch.randn(50, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows = torch.tensor([7, 0, 49, 7, 13])
    for terms in ([(direction_seed(2, 0, 1, 0), 1e-3)],
                  [(direction_seed(2, 0, 1, r), c) for r, c in enumerate((1e-3, -0.7, 2.5))]):
        whole = generator.perturb(param, 3, terms)
        cache = {}
        got = generator.perturb_rows(param, 3, terms, rows, cache)
        assert torch.equal(_bits(got), _bits(whole[rows]))
        assert torch.equal(_bits(generator.perturb_rows(param, 3, terms, rows)), _bits(whole[rows]))  # no cache
        out = torch.empty_like(param)
        written = generator.total(param, 3, terms, cache, out=out)
        assert written.data_ptr() == out.data_ptr()
        assert torch.equal(_bits(written), _bits(generator.total(param, 3, terms)))
    assert torch.equal(generator.perturb_rows(param, 3, [], rows, {}), param[rows])
    seed = direction_seed(2, 0, 1, 1)
    assert torch.equal(_bits(generator.draw_rows(param, seed, 3, rows)), _bits(generator.draw(param, seed, 3)[rows]))


def test_gaussian_moments_tails_and_independence():
    n = 1 << 22
    z = counter_stream(tensor_seed(direction_seed(0, 0, 1, 0), 0), n, "gaussian").double()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((z**3).mean())) < 5 * math.sqrt(15 / n)
    assert abs(float((z**4).mean()) - 3) < 5 * math.sqrt(96 / n)
    for x in (1.0, 2.0, 3.0, 4.0):  # P(|z| > x) against 2 Phi(-x), within 5 binomial standard deviations
        p = math.erfc(x / math.sqrt(2))
        assert abs(float((z.abs() > x).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-7, x
    assert float(z.abs().max()) <= math.sqrt(2 * 24 * math.log(2)) + 1e-6  # u >= 2^-24
    other = counter_stream(tensor_seed(direction_seed(0, 0, 1, 1), 0), n, "gaussian").double()
    next_tensor = counter_stream(tensor_seed(direction_seed(0, 0, 1, 0), 1), n, "gaussian").double()
    for a, b in ((z[::2], z[1::2]), (z[:-1], z[1:]), (z, other), (z, next_tensor)):  # pairs, neighbours, streams
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 5 / math.sqrt(len(a))


def test_gaussian_transform_is_box_muller_to_float32_accuracy():
    """Independent reference: Box-Muller in float64 with numpy's log, sqrt, cos and sin, from the same words."""
    key, pairs = 12345, 1 << 16
    words = [v & M64 for v in mix(key, torch.arange(pairs)).tolist()]
    hi = np.array([w >> 40 for w in words], dtype=np.float64)
    lo = np.array([w & 0xFFFFFF for w in words], dtype=np.float64)
    r = np.sqrt(-2 * np.log((hi + 1) / 2**24))
    octant, f = np.floor(lo / 2**21), np.mod(lo, 2**21)
    f = np.where(np.mod(octant, 2) == 1, 2**21 - 1 - f, f)  # odd octants count from their end
    v = (f + 0.5) / 2**21
    theta = (octant + np.where(np.mod(octant, 2) == 1, 1 - v, v)) * (np.pi / 4)
    expected = np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1).reshape(-1)
    got = counter_stream(key, 2 * pairs, "gaussian").double().numpy()
    assert np.max(np.abs(got - expected) / np.maximum(1.0, np.abs(expected))) < 2e-6


def test_rademacher_is_plus_minus_one_balanced_and_exact():
    n = 1 << 20
    z = counter_stream(77, n, "rademacher")
    assert set(z.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(z.double().mean())) < 5 / math.sqrt(n)
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]).double())[0, 1])) < 5 / math.sqrt(n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_stream_equals_cpu_bitwise():
    for distribution in ("gaussian", "rademacher"):
        cpu = counter_stream(99, 1 << 20, distribution)
        cuda = counter_stream(99, 1 << 20, distribution, device="cuda").cpu()
        assert torch.equal(_bits(cpu), _bits(cuda))
        assert torch.equal(mix(99, torch.arange(1000)), mix(99, torch.arange(1000, device="cuda")).cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_ledger_written_on_the_cpu_replays_bitwise_on_cuda(tmp_path, distribution, dtype):
    """The update path (fused kernel here, plain torch there): the same seeds and coefficients give the same
    weights on both devices, bit for bit, for a multi-chunk tensor too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1200, 1000), torch.nn.Linear(1000, 3)).to(dtype)
    start = copy.deepcopy(model)
    rounds = [[(direction_seed(3, t, 1, r), c) for r, c in enumerate(torch.randn(4).tolist())] for t in range(3)]
    table = ParameterTable(model, build_directions("counter", distribution))
    on_cuda = ParameterTable(start.cuda(), build_directions("counter", distribution))
    for terms in rounds:
        apply_update(table, terms, 1e-2, {0: 0.01})
        apply_update(on_cuda, terms, 1e-2, {0: 0.01})
    for a, b in zip(table.params, on_cuda.params, strict=True):
        assert torch.equal(_bits(a.detach()), _bits(b.detach().cpu()))
    seed = direction_seed(3, 0, 1, 0)
    for j, (a, b) in enumerate(zip(table.params, on_cuda.params, strict=True)):
        assert torch.equal(_bits(table.directions.perturb(a, j, [(seed, 1e-3)])),
                           _bits(on_cuda.directions.perturb(b, j, [(seed, 1e-3)]).cpu()))


def test_update_follows_the_documented_formula_with_weight_decay():
    model = LogisticRegression().double()
    table = ParameterTable(model)
    start = [p.detach().clone() for p in table.params]
    seeds = [direction_seed(5, 1, 1, r) for r in range(3)]
    coeffs, lr, wd = [0.3, -1.2, 0.05], 0.1, 0.01
    apply_update(table, list(zip(seeds, coeffs, strict=True)), lr, {0: wd})
    for j, (p, w) in enumerate(zip(table.params, start, strict=True)):
        w = w * (1 - lr * wd) if j == 0 else w
        step = sum(c * counter_stream(tensor_seed(s, j), w.numel(), "gaussian").double().view_as(w)
                   for s, c in zip(seeds, coeffs, strict=True))
        torch.testing.assert_close(p.detach(), w - lr * step, rtol=0, atol=1e-15)


@pytest.mark.parametrize("settings", [{"zo_distribution": "rademacher"}, {"zo_generator": "torch"},
                                      {"zo_schedule": "cached"}, {"zo_schedule": "two_forwards"}])
def test_runs_with_each_generator_replay_bitwise(tmp_path, settings):
    torch.manual_seed(0)
    model = LogisticRegression()
    start = copy.deepcopy(model)
    trainer = make_trainer(model, VectorDataset(128), tmp_path, max_steps=3, num_perturbations=2, weight_decay=0.01,
                           **settings)
    trainer.train()
    assert trainer.ledger.generator["name"] == settings.get("zo_generator", "counter")
    replayed = replay(start, trainer.ledger)  # on the CPU: a run on a GPU replays bitwise here
    for a, b in zip(ParameterTable(replayed).params, ParameterTable(model).params, strict=True):
        assert torch.equal(a, b.cpu())


@needs_kernel
def test_training_without_the_kernel_gives_the_same_run(tmp_path, monkeypatch):
    runs = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(native, "library", lambda: None)
        torch.manual_seed(0)
        model = LogisticRegression()
        trainer = make_trainer(model, VectorDataset(128), tmp_path / str(use_kernel), max_steps=3, num_perturbations=2)
        trainer.train()
        runs.append((trainer.ledger.rounds, torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


def test_a_client_refuses_a_plan_from_another_generator():
    from zo_byzantine.aggregators import build_aggregator
    from zo_byzantine.client import client_reports
    from zo_byzantine.server import Server, Settings

    server = Server(Settings(0), build_aggregator("mean"), ParameterTable(torch.nn.Linear(2, 1), TorchDirections()))
    plan = server.plan(0, [0], 0.1)
    with pytest.raises(ValueError, match="cannot reproduce"):
        client_reports(plan, None, ParameterTable(torch.nn.Linear(2, 1)), [0], [1])


@pytest.mark.parametrize("name, distribution, message", [
    ("philox", "gaussian", "zo_generator='philox'"),
    ("counter", "uniform", "zo_distribution='uniform'"),
    ("torch", "rademacher", "zo_generator='torch'"),
])
def test_bad_generator_settings_are_named(name, distribution, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_directions(name, distribution)


def test_a_module_returning_a_view_of_its_weight_keeps_its_values():
    """Perturbed weights are fresh tensors: a module whose output views its weight (e.g. latents.expand) is not
    overwritten by the next module of the same shape (a reused buffer would be)."""
    from zo_byzantine.perturbation import perturbed

    class Latents(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.latents = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return self.latents.expand(x.shape[0], 4, 3)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Latents(), Latents()

        def forward(self, x):
            first = self.a(x)
            second = self.b(x)
            return (first * 2 - second).sum()

    torch.manual_seed(0)
    model, x = Model(), torch.zeros(2)
    table = ParameterTable(model)
    terms = [(direction_seed(0, 0, 1, 0), 0.5)]
    with torch.no_grad(), perturbed(table, terms):
        plain = model(x)
    with torch.enable_grad(), perturbed(table, terms):  # the gradient-carrying path: always fresh tensors
        tracked = model(x)
    assert torch.equal(plain, tracked.detach())


def test_plain_path_chunks_give_the_same_stream(monkeypatch):
    whole = counter_stream(7, 1001, "gaussian")
    monkeypatch.setattr(counter, "CHUNK_PAIRS", 7)
    assert torch.equal(_bits(counter_stream(7, 1001, "gaussian")), _bits(whole))


@needs_kernel
def test_empty_terms_and_bad_buffers():
    gen, param = CounterDirections(), torch.randn(5, 7)
    assert torch.equal(gen.perturb(param, 0, []), param)
    stepped = param.clone()
    gen.step_(stepped, 0, [], lr=1.0)
    assert torch.equal(stepped, param)
    out = torch.empty_like(param)
    native.combine(param, out, [], [], True)
    assert torch.equal(out, param)
    with pytest.raises(ValueError, match="one size"):
        native.combine(param, torch.empty(3), [1], [1.0], True)


def test_complex_parameters_are_refused_by_the_counter_generator():
    with pytest.raises(ValueError, match="complex64"):
        CounterDirections().perturb(torch.zeros(3, dtype=torch.complex64), 0, [(1, 1.0)])


@needs_kernel
def test_in_place_kernel_updates_bump_autograd_versions():
    w = torch.nn.Parameter(torch.randn(1000))
    before = w._version
    with torch.no_grad():
        CounterDirections().step_(w, 0, [(1, 1.0)], lr=0.1)
    assert w._version > before


def test_no_home_directory_falls_back_to_plain_torch(monkeypatch):
    monkeypatch.delenv("ZO_BYZANTINE_CACHE", raising=False)
    monkeypatch.setenv("ZO_BYZANTINE_NATIVE", "1")

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(native.Path, "home", staticmethod(no_home))
    assert native.library.__wrapped__() is None


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize(("shape", "count"), [((50, 6), 5), ((41, 7), 9), ((4000, 101), 3000)])
def test_the_kernel_draws_rows_as_the_plain_stream_does(monkeypatch, distribution, shape, count):
    """``draw_rows`` by the compiled kernel (row by row, odd widths whose pairs straddle two rows, several threads'
    ranges for the large case) against the plain-torch path at the same elements, bit for bit."""
    from zo_byzantine import native

    if native.library() is None:
        pytest.skip("no C compiler here: the kernel path is not taken")
    generator = CounterDirections(distribution)
    like = torch.empty(shape)
    rows = torch.randint(0, shape[0], (count,), generator=torch.Generator().manual_seed(count))
    seed = direction_seed(4, 1, 0, 2)
    got = generator.draw_rows(like, seed, 5, rows)
    monkeypatch.setattr(CounterDirections, "_native", staticmethod(lambda param: False))
    expected = generator.draw_rows(like, seed, 5, rows)
    assert torch.equal(_bits(got), _bits(expected))
    assert torch.equal(_bits(expected), _bits(generator.draw(like, seed, 5)[rows]))
