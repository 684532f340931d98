"""The Triton loss kernels against the PyTorch path: loss, per-row stats and gradients for every option.

With CUDA the cases run here. Without it they run through Triton's interpreter in a child pytest process:
TRITON_INTERPRET=1 must be set before the kernels are defined and must not leak into the other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_target

from hf_dspark import DSparkModel, Eagle3Model
from hf_dspark.target import target_features
from hf_dspark.training.losses import block_draft_loss, eagle3_loss, fused_head_loss

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RUNNABLE = torch.cuda.is_available() or INTERPRETED
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not RUNNABLE, reason="no CUDA: run by test_cases_under_the_interpreter")


def test_cases_under_the_interpreter():
    if RUNNABLE:
        pytest.skip("the cases run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")}
    cases = "not under_the_interpreter and not benchmark and not trainer and not hopper"  # no kernel runs
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", __file__, "-k", cases]
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]  # every case really ran


def problem(S=37, d=40, r=20, V=150, seed=0, markov=True, target=True, dtype=torch.float32):
    """Random inputs; the target's states are near the draft's so argmax agreement is mixed, not all-false."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    h = rand(S, d)
    x = {
        "hidden": h,
        "lm_weight": rand(V, d) / d**0.25,
        "labels": torch.randint(0, V, (S,), generator=gen),
        "target_hidden": h + 0.3 * rand(S, d) if target else None,
        "markov_features": rand(S, r) if markov else None,
        "markov_weight": rand(V, r) / r**0.5 if markov else None,
    }
    return {k: None if v is None else v.to(DEVICE, v.dtype if v.dtype == torch.long else dtype) for k, v in x.items()}


def row_weights(S, terms, seed=1):
    """Per-row weights of the requested terms, with some rows at weight zero."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in ("ce_weight", "l1_weight", "soft_ce_weight"):
        if name.split("_weight")[0] in terms:
            w = torch.rand(S, generator=gen)
            w[::5] = 0.0
            weights[name] = w.to(DEVICE)
    weights.setdefault("ce_weight", torch.zeros(S, device=DEVICE))  # Eagle3 passes zeros
    return weights


def run(backend, inputs, weights, softcap, **kw):
    """(loss, stats, grads of 3 * loss w.r.t. hidden / markov features / W2) through autograd."""
    leaves = {k: inputs[k].clone().requires_grad_() for k in ("hidden", "markov_features", "markov_weight")
              if inputs[k] is not None}  # fmt: skip
    args = {**inputs, **leaves}
    ce_weight = weights["ce_weight"]
    rest = {k: v for k, v in weights.items() if k != "ce_weight"}
    loss, stats = fused_head_loss(
        args.pop("hidden"), args.pop("lm_weight"), args.pop("labels"), ce_weight, **args, **rest, softcap=softcap,
        backend=backend, **kw,
    )  # fmt: skip
    grads = torch.autograd.grad(3 * loss, list(leaves.values()))
    return loss, stats, dict(zip(leaves, grads))


def assert_same(got, want, atol=2e-5, rtol=2e-5):
    (loss, stats, grads), (ref_loss, ref_stats, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=rtol)
    for name in ("ce", "l1", "soft_ce"):
        a, b = getattr(stats, name), getattr(ref_stats, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=name)
    if ref_stats.greedy_match is not None:
        assert torch.equal(stats.greedy_match, ref_stats.greedy_match)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=atol, rtol=rtol, msg=name)


TERMS = {
    "ce (no target)": ("ce",),
    "ce + stats": ("ce",),  # a target for L1 / agreement stats, CE weighted only
    "ce + l1 (dspark)": ("ce", "l1"),
    "soft_ce (eagle3)": ("soft_ce",),
    "all three": ("ce", "l1", "soft_ce"),
}


@kernels
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("markov", [False, True])
@pytest.mark.parametrize("case", list(TERMS))
def test_triton_matches_the_torch_path(case, markov, softcap):
    inputs = problem(S=70, markov=markov, target=case != "ce (no target)")  # 2 row blocks, V and d ragged
    weights = row_weights(70, TERMS[case])
    got = run("triton", inputs, weights, softcap)
    want = run("torch", inputs, weights, softcap)
    assert_same(got, want)
    if inputs["target_hidden"] is not None:
        assert 0 < want[1].greedy_match.sum() < 70  # agreement is exercised both ways


@kernels
@pytest.mark.parametrize(
    "num_splits, grad_mode, terms",
    [(1, "fused", "all"), (2, "fused", "all"), (3, "fused", "all"), (2, "chunked", "all"), (3, "fused", "soft_ce"),
     (2, "chunked", "soft_ce")],
)  # fmt: skip
def test_ragged_tiles_and_vocabulary_splits(num_splits, grad_mode, terms):
    """Tiles smaller than every dimension, none of which is a multiple of its tile; split partials combined;
    without L1, pass 3 forms the L1 / soft-CE sums itself (no pass 2)."""
    from hf_dspark.training.triton_head_loss import TileConfig, triton_head_loss

    inputs = problem(S=37, d=40, r=20, V=150)
    weights = row_weights(37, ("ce", "l1", "soft_ce") if terms == "all" else ("soft_ce",))
    _, stats, grads = run("torch", inputs, weights, softcap=7.0)
    result = triton_head_loss(
        inputs["hidden"], inputs["lm_weight"], inputs["labels"], weights["ce_weight"],
        target_hidden=inputs["target_hidden"], markov=inputs["markov_features"],
        markov_weight=inputs["markov_weight"], w_l1=weights.get("l1_weight"), w_soft=weights["soft_ce_weight"],
        softcap=7.0, tiles=TileConfig(block_m=16, block_v=32, block_d=16, num_warps=4, num_stages=1),
        num_splits=num_splits, grad_mode=grad_mode, chunk_elements=16 * 150,  # "chunked": 16 rows a chunk
    )  # fmt: skip
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(result.ce, stats.ce, **tol)
    torch.testing.assert_close(result.l1, stats.l1, **tol)
    torch.testing.assert_close(result.soft_ce, stats.soft_ce, **tol)
    assert torch.equal(result.greedy_match, stats.greedy_match)
    torch.testing.assert_close(3 * result.grad_hidden, grads["hidden"], **tol)
    torch.testing.assert_close(3 * result.grad_markov, grads["markov_features"], **tol)
    torch.testing.assert_close(3 * result.grad_markov_weight, grads["markov_weight"], **tol)


@kernels
def test_argmax_ties_resolve_to_the_first_index_across_tiles_and_splits():
    """Like torch.argmax: the draft's logits tie exactly at 10 and 80 (vocabulary tiles 0 and 2, splits 0 and 1);
    the target's unique maximum at 10 (then at 80) agrees only with the first of the tied entries."""
    from hf_dspark.training.triton_head_loss import TileConfig, triton_head_loss

    S, d, V = 20, 16, 96
    W = torch.randn(V, d, generator=torch.Generator().manual_seed(0)) * 0.01
    W[10], W[80] = 0.0, 0.0
    W[10, :2] = 1.0  # draft e0 -> 1 at both; target e0 + e1 -> 2 at 10, e0 + e2 -> 2 at 80
    W[80, 0], W[80, 2] = 1.0, 1.0
    h = torch.zeros(S, d)
    h[:, 0] = 1.0
    assert ((h @ W.T).argmax(-1) == 10).all()
    for column, agrees in ((1, True), (2, False)):
        t = h.clone()
        t[:, column] = 1.0
        result = triton_head_loss(
            h.to(DEVICE), W.to(DEVICE), torch.zeros(S, dtype=torch.long, device=DEVICE),
            torch.ones(S, device=DEVICE), target_hidden=t.to(DEVICE), grads=(False, False, False),
            tiles=TileConfig(block_m=16, block_v=32, block_d=16, num_warps=4, num_stages=1), num_splits=2,
        )  # fmt: skip
        assert result.greedy_match.tolist() == [agrees] * S


@kernels
def test_bf16_inputs_accumulate_in_fp32():
    inputs = problem(S=40, dtype=torch.bfloat16)
    weights = row_weights(40, ("ce", "l1"))
    got = run("triton", inputs, weights, softcap=None)
    exact = run("torch", {k: v if v is None or v.dtype == torch.long else v.float() for k, v in inputs.items()},
                weights, softcap=None)  # fmt: skip
    loss, stats, grads = got
    assert loss.dtype == torch.float32 and grads["hidden"].dtype == torch.bfloat16
    torch.testing.assert_close(loss, exact[0], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(stats.l1, exact[1].l1, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grads["hidden"].float(), exact[2]["hidden"], atol=2e-2, rtol=5e-2)


@kernels
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: soft-capped logits
def test_dspark_objective_through_the_triton_backend(family):
    target = make_tiny_target(family).float()
    draft = DSparkModel.from_target(target, num_hidden_layers=1, block_size=4, markov_rank=8, num_anchors=6)
    draft = draft.float().to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, target.config.vocab_size, (2, 24), generator=gen)
    loss_mask = torch.zeros(2, 24, dtype=torch.long)
    loss_mask[0, 4:], loss_mask[1, 9:] = 1, 1
    ctx, last = target_features(target, input_ids, draft.config.target_layer_ids)
    out = draft(input_ids.to(DEVICE), ctx.to(DEVICE), loss_mask.to(DEVICE), target_last_hidden=last.to(DEVICE),
                generator=torch.Generator(device=DEVICE).manual_seed(0))  # fmt: skip
    results = [block_draft_loss(draft, out, backend=b) for b in ("triton", "torch")]
    params = [p for p in draft.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(r.loss, params, retain_graph=True) for r in results]
    torch.testing.assert_close(results[0].loss, results[1].loss, atol=1e-5, rtol=1e-5)
    for key in results[1].terms:
        torch.testing.assert_close(results[0].terms[key], results[1].terms[key], atol=1e-5, rtol=1e-5)
    for key in results[1].estimates:
        torch.testing.assert_close(results[0].estimates[key], results[1].estimates[key], atol=1e-5, rtol=1e-5)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@kernels
def test_eagle3_objective_through_the_triton_backend():
    target = make_tiny_target("qwen2").float()
    draft = Eagle3Model.from_target(target, block_size=3).float().to(DEVICE)
    input_ids = torch.randint(3, target.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(2, 24, dtype=torch.long)
    loss_mask[:, 6:] = 1
    ctx, last = target_features(target, input_ids, draft.config.target_layer_ids)
    out = draft(input_ids.to(DEVICE), ctx.to(DEVICE), loss_mask.to(DEVICE), target_last_hidden=last.to(DEVICE))
    results = [eagle3_loss(draft, out, backend=b) for b in ("triton", "torch")]
    params = [p for p in draft.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(r.loss, params, retain_graph=True) for r in results]
    torch.testing.assert_close(results[0].loss, results[1].loss, atol=1e-5, rtol=1e-5)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_loss_kernel_benchmark_smoke(tmp_path):
    """benchmarks/loss_kernel.py --device cpu --smoke: every variant agrees with the fp32 reference; JSON written.
    (A child process: the script sets TRITON_INTERPRET for itself.)"""
    import json

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "loss_kernel.py")
    out = tmp_path / "loss_kernel.json"
    cmd = [sys.executable, script, "--device", "cpu", "--smoke", "--settings", "production", "--variants",
           "torch-eager", "triton", "triton-chunked", "--output", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("loss_kernel.py --device cpu --smoke") and report["device"]
    (setting,) = report["settings"]
    assert [v["variant"] for v in setting["variants"]] == ["torch-eager", "triton", "triton-chunked"]
    for variant in setting["variants"]:
        accuracy = variant["accuracy_vs_fp32"]
        assert variant["ms"] > 0 and accuracy["loss"]["max_rel"] < 1e-3, variant
        assert accuracy["grad_hidden"]["max_rel"] < 5e-2 and accuracy["grad_markov_weight"]["max_rel"] < 5e-2
    assert "| production | triton-chunked" in proc.stdout.splitlines()[-1]


def test_draft_trainer_passes_loss_backend(tmp_path, monkeypatch):
    """DraftTrainingArguments.loss_backend reaches fused_head_loss; a bad value stops training with the choices."""
    import datasets

    from hf_dspark.training import DraftTrainer, DraftTrainingArguments, build_draft, losses

    target = make_tiny_target("llama")
    rows = datasets.Dataset.from_list(
        [{"input_ids": list(range(3, 23)), "loss_mask": [0] * 4 + [1] * 16} for _ in range(2)]
    )
    seen = []
    resolve = losses.resolve_backend
    monkeypatch.setattr(losses, "resolve_backend", lambda backend, *a: seen.append(backend) or resolve(backend, *a))
    for backend in ("torch", "cuda"):
        args = DraftTrainingArguments(
            output_dir=str(tmp_path / backend), max_steps=1, per_device_train_batch_size=2, report_to="none",
            save_strategy="no", use_cpu=True, disable_tqdm=True, block_size=4, num_hidden_layers=1, num_anchors=4,
            loss_backend=backend,
        )  # fmt: skip
        trainer = DraftTrainer(model=build_draft(target, args), args=args, train_dataset=rows, target_model=target)
        if backend == "torch":
            trainer.train()
        else:
            with pytest.raises(ValueError, match="auto, triton, torch"):
                trainer.train()
    assert seen == ["torch", "cuda"]


@pytest.mark.skipif(INTERPRETED, reason="compiles the kernels themselves (the interpreter replaces them)")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter does not compile: build the passes for sm_90 with the default bf16 tiles (the bundled ptxas
    needs no GPU), with every feature on, and check they fit Hopper's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton
    from hf_dspark.training import triton_head_loss as kernels

    tiles = kernels.DEFAULT_TILES[torch.bfloat16]
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_V=tiles.block_v, BLOCK_D=tiles.block_d, PRECISION="tf32")
    flags = {
        kernels._pass1_kernel: dict(HAS_TARGET=True, HAS_MARKOV=True, SOFTCAP=True),
        kernels._pass2_kernel: dict(HAS_MARKOV=True, SOFTCAP=True),
        kernels._pass3_kernel: dict(HAS_MARKOV=True, HAS_L1=True, HAS_SOFT=True, SOFTCAP=True, GRAD_H=True,
                                    GRAD_Z=True, GRAD_W2=True, STORE_G=False, SUMS=False),
    }  # fmt: skip
    int_args = {"S", "V", "D", "R", "tiles_per_split"}
    bf16_args = {"h_ptr", "t_ptr", "z_ptr", "w_ptr", "w2_ptr", "g_ptr"}
    for fn, constexprs in flags.items():
        constexprs = {**constexprs, **blocks}
        signature = {}
        for name in fn.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in int_args:
                signature[name] = "i32"
            elif name == "cap":
                signature[name] = "fp32"
            elif name in bf16_args:
                signature[name] = "*bf16"
            else:
                signature[name] = "*i32" if name in ("labels_ptr", "idx_ptr") else "*fp32"
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if signature[name].startswith("*") or name in ("S", "V", "D", "R")}  # fmt: skip
        try:
            source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
        except TypeError as err:  # ASTSource's arguments follow Triton 3.3+
            pytest.skip(f"this Triton's ahead-of-time API differs: {err}")
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})  # fmt: skip
        assert "wgmma" in compiled.asm["ptx"], fn.__name__  # tensor-core products
        assert compiled.metadata.shared <= 227 * 1024, (fn.__name__, compiled.metadata.shared)
