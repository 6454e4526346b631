"""The float64 reference of the speedrun recipe (tests/speedrun_reference.py) held to the recipe's own code: its
model file's names and shapes, its Newton-Schulz, rotary and soft cap, its optimizer groups and schedule,
and what the recipe's own init lets the first steps move."""
import math

import numpy as np
import pytest
import torch

import speedrun_reference as ref
from conftest import write_shard

V = 50304
# one torch thread throughout, as conftest's one_thread explains: these small float64 ops gain nothing from
# more, and on a busy 2-core machine threads slow each other down
pytestmark = pytest.mark.usefixtures("one_thread")


def spec_shapes(L, C):
    """The tensor names and shapes of the reference's GPT.state_dict(), written out by hand."""
    s = {"embed.weight": (V, C)}
    for i in range(L):
        b = f"blocks.{i}."
        for lin in "qkv":
            s[b + f"attn.{lin}.weight"], s[b + f"attn.{lin}.bias"] = (C, C), (C,)
        s[b + "attn.proj.weight"], s[b + "attn.proj.bias"] = (C, C), (C,)
        s[b + "attn.rotary.angular_freq"] = (64,)  # head dim 128: 32 frequencies and 32 zeros
        s[b + "mlp.fc.weight"], s[b + "mlp.fc.bias"] = (4 * C, C), (4 * C,)
        s[b + "mlp.proj.weight"], s[b + "mlp.proj.bias"] = (C, 4 * C), (C,)
        s[b + "norm1.gains"], s[b + "norm2.gains"] = (C,), (C,)
    s.update({"proj.weight": (V, C), "proj.bias": (V,), "norm1.gains": (C,), "norm2.gains": (C,)})
    return s


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A tiny train shard of 2,000 random tokens drawn from 256 ids, so that a few steps lower the loss."""
    path = tmp_path_factory.mktemp("speedrun") / "rand_train_000001.bin"
    write_shard(path, np.random.default_rng(0).integers(0, 256, 2000))
    return str(path)


@pytest.fixture(scope="module")
def init_file(tmp_path_factory):
    """The recipe's own init of L2 C128 (head and projections zero)."""
    path = tmp_path_factory.mktemp("speedrun") / "init.safetensors"
    ref.write_model_file(path, ref.init_state_dict(2, 128, seed=0))
    return path


def test_names_and_shapes_are_the_spec_list():
    model = ref.GPT(2, 256)
    sd = model.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == spec_shapes(2, 256)
    # the rotary frequencies are a buffer, not a parameter; every other tensor is trained
    assert set(sd) - {n for n, _ in model.named_parameters()} == {f"blocks.{i}.attn.rotary.angular_freq"
                                                                  for i in range(2)}
    freq = sd["blocks.0.attn.rotary.angular_freq"].numpy()
    np.testing.assert_allclose(freq[:32], (1 / 1024) ** np.linspace(0, 1, 32), rtol=1e-6)
    assert (freq[32:] == 0).all() and freq[0] == 1.0


def test_init_state_dict():
    """The recipe's init, in state_dict order, from the seed alone."""
    L, C = 2, 128
    a, b, c = (ref.init_state_dict(L, C, seed) for seed in (1, 1, 2))
    assert list(a) == [n for n, _ in ref.state_shapes(L, C)]
    assert all(v.dtype == np.float32 and v.shape == spec_shapes(L, C)[k] for k, v in a.items())
    assert all(np.array_equal(a[k], b[k]) for k in a) and not np.array_equal(a["embed.weight"],
                                                                              c["embed.weight"])
    for name, t in a.items():
        if name.endswith("weight") and "proj" in name or name.endswith("bias"):
            assert not t.any(), name
        elif name.endswith("gains"):
            assert (t == 1).all(), name
    assert abs(a["embed.weight"].std() - 1) < 0.01
    for name, fan_in in (("blocks.1.attn.k.weight", C), ("blocks.0.mlp.fc.weight", C)):
        assert abs(a[name].std() / (0.33 ** 0.5 / math.sqrt(fan_in)) - 1) < 0.02, name
        assert abs(a[name].mean()) < 4 * a[name].std() / math.sqrt(a[name].size)
    np.testing.assert_array_equal(a["blocks.1.attn.rotary.angular_freq"], ref.rotary_freq().numpy())


def test_model_file_round_trip(tmp_path):
    """A file written and read back is bit for bit the state; loaded into GPT (float64) it is the same
    values; a model's own state_dict written out loads back unchanged."""
    rng = np.random.default_rng(3)
    state = {n: rng.standard_normal(s).astype(np.float32) for n, s in ref.state_shapes(1, 128)}
    path = tmp_path / "m.safetensors"
    ref.write_model_file(path, state)
    back = ref.read_model_file(path)
    assert set(back) == set(state)
    for k in state:
        assert back[k].dtype == np.float32 and np.array_equal(back[k], state[k]), k
    model = ref.load_model(path)
    assert all(v.dtype == torch.float64 and np.array_equal(v.numpy(), state[k])
               for k, v in model.state_dict().items())
    ref.write_model_file(tmp_path / "again.safetensors", model.state_dict())
    assert (tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_newton_schulz_singular_values():
    """12 iterations bring every singular value of a random matrix into a band around 1. The polynomial
    2s - 1.5s^3 + 0.5s^5 peaks at 1.0019, the top of the band; a wide or tall Gaussian matrix is well
    conditioned and lands on 1 to rounding; a square one has singular values near 0, which each iteration
    only doubles (measured for this matrix: 0.662 to 1 + 3e-12)."""
    g = torch.Generator().manual_seed(0)
    G = {s: torch.randn(*s, generator=g, dtype=torch.float64) for s in ((64, 64), (32, 96), (96, 32))}
    for shape, m in G.items():
        sv = torch.linalg.svdvals(ref.newton_schulz(m))
        lo = 0.6 if shape[0] == shape[1] else 1 - 1e-12
        hi = 1.002 if shape[0] == shape[1] else 1 + 1e-12
        assert lo < sv.min() and sv.max() < hi, (shape, sv.min().item(), sv.max().item())
    # tall runs on the transpose: exactly the transpose of the wide case on the transposed input
    assert torch.equal(ref.newton_schulz(G[(96, 32)]), ref.newton_schulz(G[(96, 32)].T).T)
    assert torch.equal(ref.newton_schulz(G[(32, 96)].T), ref.newton_schulz(G[(32, 96)]).T)
    # a matrix with singular values in [1, 3] converges to its polar factor U Vᵀ, whichever its orientation
    U, _, Vh = torch.linalg.svd(G[(32, 96)], full_matrices=False)
    M = U @ torch.diag(torch.linspace(1, 3, 32, dtype=torch.float64)) @ Vh
    torch.testing.assert_close(ref.newton_schulz(M), U @ Vh, rtol=0, atol=1e-13)
    torch.testing.assert_close(ref.newton_schulz(M.T), Vh.T @ U.T, rtol=0, atol=1e-13)
    assert ref.newton_schulz(M.float()).dtype == torch.float32  # runs in the input's dtype


def test_muon_update():
    """Two steps of muon_update: momentum lerp, Nesterov lerp, NS, the tall matrix's sqrt(rows/cols) scale,
    decoupled decay p *= 1 - lr*wd, all recomputed here from the reference's formulas."""
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(96, 24, generator=g, dtype=torch.float64)
    g1, g2 = (torch.randn(96, 24, generator=g, dtype=torch.float64) for _ in range(2))
    p, buf, lr, wd, g1_before = p0.clone(), torch.zeros_like(p0), 0.025, 0.05, g1.clone()
    ref.muon_update(p, g1, buf, lr, wd)
    buf1 = 0.05 * g1
    torch.testing.assert_close(buf, buf1, rtol=1e-14, atol=1e-17)
    expect = p0 * (1 - lr * wd) - lr * 2.0 * ref.newton_schulz(g1 + 0.95 * (buf1 - g1))  # sqrt(96/24) = 2
    torch.testing.assert_close(p, expect, rtol=0, atol=1e-14)
    ref.muon_update(p, g2, buf, lr, wd)
    buf2 = 0.95 * buf1 + 0.05 * g2
    torch.testing.assert_close(buf, buf2, rtol=1e-14, atol=1e-16)
    expect = expect * (1 - lr * wd) - lr * 2.0 * ref.newton_schulz(g2 + 0.95 * (buf2 - g2))
    torch.testing.assert_close(p, expect, rtol=0, atol=1e-14)
    assert torch.equal(g1, g1_before)  # the gradient is left as it was (the reference's Muon overwrites it)


def test_rotary():
    """q.k after rotary depends on the position difference only; the 32 zero frequencies leave their dims
    alone; a unit vector in dim j < 32 turns to (cos, -sin)(t f_j) in dims (j, j + 64), the issue's signs."""
    rot = ref.Rotary(128).double()
    T = 40
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 128, generator=g, dtype=torch.float64)
    rq, rk = (rot(v.expand(1, T, 1, 128))[0, :, 0] for v in (q, k))  # the vector at every position
    for m, n, s in ((5, 2, 7), (3, 3, 20), (0, 9, 30), (17, 1, 22)):
        torch.testing.assert_close(rq[m] @ rk[n], rq[m + s] @ rk[n + s], rtol=1e-12, atol=1e-12)
    assert abs(rq[5] @ rk[2] - rq[5] @ rk[3]) > 1e-3  # it does depend on the difference
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(T), rtol=1e-13, atol=0)
    assert torch.equal(rq[0], q)
    for half in (slice(32, 64), slice(96, 128)):
        assert torch.equal(rq[:, half], q[half].expand(T, 32))
    freq = (1 / 1024) ** torch.linspace(0, 1, 32, dtype=torch.float32).double()
    j, t = 7, 13
    y = rot(torch.eye(128, dtype=torch.float64)[j].expand(1, T, 1, 128))[0, t, 0]
    torch.testing.assert_close(y[[j, j + 64]], torch.stack([torch.cos(t * freq[j]), -torch.sin(t * freq[j])]))


def test_forward_matches_the_formulas():
    """GPT's logits against the issue's formulas written out here in numpy (L1, C256: two heads): RMSNorm
    with the dtype's eps, per-head q, k RMS-normed without gain, rotary pairs (j, j + 64) turned by
    t * freq_j, causal softmax with scale 0.12, relu^2 MLP, pre-norm residuals, soft cap."""
    C, H, T = 256, 2, 6
    g = torch.Generator().manual_seed(4)
    with torch.random.fork_rng():
        torch.manual_seed(4)
        model = ref.GPT(1, C).double()  # torch's default init: every weight and bias random and nonzero
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gains"):
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64), alpha=0.1)
    idx = torch.tensor([[3, 50256, 7, 7, 1000, 2]])
    P = {k: v.numpy() for k, v in model.state_dict().items()}
    eps = np.finfo(np.float64).eps

    def rms(x, gain=1.0):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gain

    def lin(x, name):
        return x @ P[name + ".weight"].T + P[name + ".bias"]

    freq = P["blocks.0.attn.rotary.angular_freq"]
    angle = np.arange(T)[:, None] * freq[None, :]  # (T, 64)

    def rotate(x):  # (T, 128)
        a, b = x[:, :64], x[:, 64:]
        cos, sin = np.cos(angle), np.sin(angle)
        return np.concatenate([a * cos + b * sin, -a * sin + b * cos], 1)

    x = rms(P["embed.weight"][idx.numpy()[0]], P["norm1.gains"])
    h = rms(x, P["blocks.0.norm1.gains"])
    q, k, v = (lin(h, f"blocks.0.attn.{n}") for n in "qkv")
    heads = []
    for i in range(H):
        s = slice(128 * i, 128 * (i + 1))
        qi, ki = rotate(rms(q[:, s])), rotate(rms(k[:, s]))
        att = 0.12 * qi @ ki.T + np.triu(np.full((T, T), -np.inf), 1)
        att = np.exp(att - att.max(1, keepdims=True))
        heads.append((att / att.sum(1, keepdims=True)) @ v[:, s])
    x = x + lin(np.concatenate(heads, 1), "blocks.0.attn.proj")
    x = x + lin(np.maximum(lin(rms(x, P["blocks.0.norm2.gains"]), "blocks.0.mlp.fc"), 0) ** 2,
                "blocks.0.mlp.proj")
    z = lin(rms(x, P["norm2.gains"]), "proj")
    expect = 15 * z / np.sqrt(z * z + 225)
    np.testing.assert_allclose(model(idx)[0].detach().numpy(), expect, rtol=1e-10, atol=1e-12)


def test_softcap_bounds_logits():
    z = torch.tensor([-1e6, -300.0, -15.0, -1e-3, 0.0, 1e-3, 15.0, 300.0, 1e6], dtype=torch.float64)
    c = ref.softcap(z)
    assert (c.abs() < 15).all() and (c.diff() > 0).all() and torch.equal(c, -c.flip(0))
    torch.testing.assert_close(c[[3, 5]], z[[3, 5]], rtol=1e-8, atol=0)  # ~z near 0
    torch.testing.assert_close(c[6], torch.tensor(15 / 2 ** 0.5, dtype=torch.float64))
    # a model whose head would give logits in the thousands: all inside (-15, 15), some near the bounds
    model = ref.GPT(1, 128).double()
    with torch.no_grad():
        model.proj.weight.normal_(0, 100, generator=torch.Generator().manual_seed(0))
    logits = model(torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0)))
    assert logits.dtype == torch.float64 and logits.shape == (1, 8, V)
    assert logits.abs().max() < 15 and logits.max() > 14.9 and logits.min() < -14.9


def test_lr_schedule():
    """Step 0 is the first update: 1 for the first 30% of the steps, then (1 - step/steps) / 0.7."""
    eta = [ref.lr_multiplier(s, 10) for s in range(10)]
    assert eta[:4] == [1.0] * 4  # steps 0, 1, 2 and 3 (= 30%: the decay starts at 1 there anyway)
    np.testing.assert_allclose(eta[3:], [(1 - s / 10) / 0.7 for s in range(3, 10)], rtol=1e-15)


def test_optimizer_groups():
    model = ref.GPT(2, 128).double()
    adamw, muon = ref.make_optimizers(model)
    named = dict(model.named_parameters())
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    lrs = {g["lr"]: ids(g["params"]) for g in adamw.param_groups}
    assert lrs == {0.7: ids([named["embed.weight"]]), 0.004: ids([named["proj.weight"]]),
                   0.015: ids(p for n, p in named.items() if n.endswith(("bias", "gains")))}
    assert ids(p for p, _ in muon) == ids(p for n, p in named.items() if n.startswith("blocks.")
                                          and n.endswith("weight") and "norm" not in n)
    assert len(muon) == 2 * 6 and all(torch.equal(b, torch.zeros_like(p)) for p, b in muon)
    d = adamw.defaults
    assert (d["betas"], d["eps"], d["weight_decay"]) == ((0.8, 0.95), 1e-10, 0.001)


def test_first_steps_from_the_recipe_init(init_file, shard):
    """From the recipe's init the head (and every projection) is zero, so the logits are all 0 and the
    first loss is ln(50304). The gradient reaches only the head: everything below it hangs off the zero head
    weight. The first step then changes the head by Adam, and every other tensor only by its weight decay
    (p *= 1 - lr*wd): the embedding, the gains and q, k, v, fc shrink a little, so the "first step moves
    only the head" of the recipe's description holds for the gradient's move, not the decay's; the zero projections and
    biases stay exactly 0. At the second step the head is nonzero: the gradient reaches the embedding, the
    final norms and the attention and MLP projections (zero matrices with a nonzero gradient), but not yet
    q, k, v, fc or the block norms, which still hang off the zero projections."""
    model = ref.load_model(init_file)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    adamw, muon = ref.make_optimizers(model)
    B, T, accum = 2, 32, 2
    loader = ref.Loader([shard], B, T)
    loss = ref.accumulate(model, loader, accum)
    N = accum * B * T
    assert loss / N == pytest.approx(math.log(V), rel=1e-14)
    # the summed-loss convention: d(sum of CE)/d(head bias) = sum over tokens of (softmax - onehot)
    targets = ref.Loader([shard], accum * B, T).next_batch()[1].reshape(-1)  # the step's targets at once
    expect = N / V - torch.bincount(targets, minlength=V).double()
    torch.testing.assert_close(model.proj.bias.grad, expect, rtol=1e-12, atol=1e-12)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["proj.weight"].abs().sum() > 0
    assert all(not g.any() for n, g in grads.items() if not n.startswith("proj.")), "gradient below head"

    ref.optimizer_step(adamw, muon, 0, 6)
    after = model.state_dict()
    for name, t in after.items():
        if name.startswith("proj."):
            assert (t != init[name]).all(), name  # Adam's first step: lr * sign(grad) where grad != 0
            continue
        if name.endswith("angular_freq"):
            lr, wd = 0.0, 0.0
        elif name == "embed.weight":
            lr, wd = 0.7, 0.001
        elif name.endswith(("bias", "gains")):
            lr, wd = 0.015, 0.001
        else:
            lr, wd = 0.025, 0.05  # Muon; its zero gradient gives a zero update
        assert torch.equal(t, init[name] * (1 - lr * wd)), name
        if name.endswith("bias") or "proj" in name:
            assert not t.any(), name

    model.zero_grad(set_to_none=True)
    ref.accumulate(model, loader, 1)  # one micro-batch shows where the second step's gradient reaches
    reached = {n for n, p in model.named_parameters() if p.grad.any()}
    assert reached == {"embed.weight", "norm1.gains", "norm2.gains", "proj.weight", "proj.bias"} | {
        f"blocks.{i}.{m}.proj.{w}" for i in range(2) for m in ("attn", "mlp") for w in ("weight", "bias")}


def test_train_is_deterministic_and_learns(init_file, shard):
    """Two steps of two micro-batches from the recipe's init (the second one in the decay: lr x 0.5/0.7):
    the loss starts at ln(50304) and falls (measured: by 0.018), and two runs agree bit for bit."""
    a = ref.train(init_file, [shard], 2, 32, 128, 2)
    b = ref.train(init_file, [shard], 2, 32, 128, 2)
    assert a == b and len(a) == 2 and all(math.isfinite(x) for x in a)
    assert a[0] == pytest.approx(math.log(V), rel=1e-14)
    assert a[1] < a[0] - 0.01, a


def test_train_from_a_random_init(tmp_path, shard):
    """From an init in which every tensor is random and nonzero (the rotary frequencies aside), every
    parameter gets a gradient at the first step, the update moves every one, and the loss is finite."""
    rng = np.random.default_rng(5)
    state = {n: (rng.standard_normal(s) * (0.05 if n != "embed.weight" else 1.0)).astype(np.float32)
             for n, s in ref.state_shapes(2, 128)}
    for n in state:
        if n.endswith("angular_freq"):
            state[n] = ref.rotary_freq().numpy()
        elif n.endswith("gains"):
            state[n] += 1
    path = tmp_path / "random.safetensors"
    ref.write_model_file(path, state)
    losses, model = ref.train(path, [shard], 2, 32, 64, 1, return_model=True)
    assert all(p.grad.any() for p in model.parameters())  # the .grad of the last step stays
    assert all((p != torch.from_numpy(state[n])).any() for n, p in model.named_parameters())
    assert len(losses) == 1 and math.isfinite(losses[0])
