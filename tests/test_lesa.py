"""`--method lesa`: function preservation with zero-init on every dense family, the published
setting's numbers against a separate reimplementation of the LESA notebook's formulas, seeds, the
leave-one-out check, and the options."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.methods.lesa import LesaOptions
from otdus_cli.methods.lesa.builder import generator_seed, gram_matrix
from otdus_cli.options import ExpandOptions
from tests.support.expansion_checks import assert_layers_match_sources, base_reference
from tests.support.tiny_models import DENSE_TYPES, load_causal_lm, logits

pytestmark = pytest.mark.usefixtures("single_thread")

ROLES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
QUICK = LesaOptions(epochs=2)  # where the predictor's quality does not matter


def new_layers(manifest: dict) -> list[dict]:
    return [lay for lay in manifest["layers"] if lay["new"]]


@pytest.mark.parametrize("model_type", DENSE_TYPES)
def test_zero_init_lesa_is_an_exact_identity_on_every_dense_family(tiny_models, tmp_path, model_type):
    src = tiny_models[model_type]
    depth = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    result = expand(str(src), tmp_path / "out", ExpandOptions(method="lesa", layers=depth // 2, lesa=QUICK))
    manifest = result.manifest
    assert manifest["function_preserving"] and all(lay["zero_init"] for lay in new_layers(manifest))
    assert torch.equal(base_reference(src)[1], logits(load_causal_lm(tmp_path / "out")))
    assert_layers_match_sources(src, tmp_path / "out", manifest)
    # same placements as ot: new layer after base layer i, built from (i, i+1)
    assert [lay["parents"] for lay in new_layers(manifest)] == [
        [i, i + 1] for i in range(depth - depth // 2 - 1, depth - 1)
    ]
    report = manifest["lesa"]
    assert report["variant"] == "pair" and set(report["skipped"]) == {"o", "down"}
    assert set(report["projections"]) == {"q", "k", "v", "gate", "up"}
    # the pair variant takes what LESA does not predict from the pair; predicted weights are new
    r, a = CheckpointReader(tmp_path / "out"), CheckpointReader(src)
    lay = new_layers(manifest)[0]
    i, j = lay["parents"]
    norm = "input_layernorm.weight"
    want = (a.get(f"model.layers.{i}.{norm}").float() + a.get(f"model.layers.{j}.{norm}").float()) * 0.5
    assert torch.equal(
        r.get(f"model.layers.{lay['index']}.{norm}"), want.to(a.get(f"model.layers.{i}.{norm}").dtype)
    )
    up = "mlp.gate_up_proj.weight" if model_type == "phi3" else "mlp.up_proj.weight"
    new_up = r.get(f"model.layers.{lay['index']}.{up}")
    assert new_up.abs().sum() > 0
    assert all(not torch.equal(new_up, a.get(f"model.layers.{n}.{up}")) for n in range(depth))


# -- the published setting against a separate reimplementation --------------------------------------


def notebook_lesa(weights: list[torch.Tensor], role: str, seed: int, pairs: list[tuple[int, int]], held: int):
    """The LESA notebook's computation for one projection type, written out plainly: SVD of the
    concatenation along the input dimension, (V_{l-1}, V_{l+1}) -> V_l training rows stacked layer by
    layer, nn.Linear MLP, nn.MSELoss with the norm term, torch AdamW, shuffled batches of 64.
    Differences from the notebook are the ones otdus documents: fixed singular-vector signs, a seeded
    generator (init drawn as +-1/sqrt(fan_in) uniforms, one randperm per epoch).
    Returns the new weights for ``pairs`` and the leave-one-out errors for layer ``held``."""
    m = torch.cat([w.double() for w in weights], dim=1)
    u, s, vt = torch.linalg.svd(m, full_matrices=False)
    flip = u[u.abs().argmax(dim=0), torch.arange(u.shape[1])].sign()
    u, vt = u * flip, vt * flip[:, None]
    width = weights[0].shape[1]
    blocks = [vt[:, i * width : (i + 1) * width].float() for i in range(len(weights))]
    us = (u * s).float()

    def train(targets: list[int], generator_seed_value: int) -> torch.nn.Module:
        x = torch.cat([torch.cat([blocks[t - 1], blocks[t + 1]], dim=1) for t in targets])
        y = torch.cat([blocks[t] for t in targets])
        gen = torch.Generator().manual_seed(generator_seed_value)
        net = torch.nn.Sequential(
            torch.nn.Linear(2 * width, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, width),
        )
        with torch.no_grad():
            for linear in (net[0], net[2], net[4]):
                bound = 1 / math.sqrt(linear.in_features)
                linear.weight.copy_((torch.rand(linear.weight.shape, generator=gen) * 2 - 1) * bound)
                linear.bias.copy_((torch.rand(linear.bias.shape, generator=gen) * 2 - 1) * bound)
        criterion = torch.nn.MSELoss(reduction="mean")
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.001)
        for _ in range(10):
            order = torch.randperm(len(x), generator=gen)
            for start in range(0, len(x), 64):
                batch = order[start : start + 64]
                out = net(x[batch])
                mse = criterion(out, y[batch])
                norm = criterion(torch.norm(out, p=2), torch.norm(y[batch], p=2))
                loss = (1 - 0.0005) * mse + 0.0005 * norm
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        return net

    def rebuild(net: torch.nn.Module, before: int, after: int) -> torch.Tensor:
        with torch.no_grad():
            return us @ net(torch.cat([blocks[before], blocks[after]], dim=1))

    interior = list(range(1, len(weights) - 1))
    net = train(interior, generator_seed(seed, role))
    new = {pair: rebuild(net, *pair) for pair in pairs}
    loo_net = train([t for t in interior if t != held], generator_seed(seed, role, held))

    def error(w: torch.Tensor) -> float:
        return float((w.double() - weights[held].double()).norm() / weights[held].double().norm())

    errors = {
        "error": error(rebuild(loo_net, held - 1, held + 1)),
        "fit_error": error(rebuild(net, held - 1, held + 1)),
        "average_error": error((weights[held - 1] + weights[held + 1]) * 0.5),
    }
    return new, errors


def test_published_setting_matches_a_reimplementation_of_the_notebook(tiny_models, tmp_path):
    src = tiny_models["llama"]  # 4 layers, float32
    options = ExpandOptions(method="lesa", layers=2, seed=5, lesa=LesaOptions(variant="published"))
    result = expand(str(src), tmp_path / "out", options)
    manifest = result.manifest
    assert not manifest["function_preserving"] and not any(lay["zero_init"] for lay in new_layers(manifest))
    report = manifest["lesa"]
    assert report["variant"] == "published" and report["skipped"] == {}
    assert report["settings"] | {"device": "cpu"} == {
        "hidden": 256, "epochs": 10, "batch_size": 64, "lr": 0.001, "weight_decay": 0.01,
        "norm_weight": 0.0005, "rank": None, "loo": 1, "seed": 5, "device": "cpu",
    }  # fmt: skip
    a, r = CheckpointReader(src), CheckpointReader(tmp_path / "out")
    placed = {tuple(lay["parents"]): lay["index"] for lay in new_layers(manifest)}
    assert list(placed) == [(1, 2), (2, 3)]
    held = report["projections"]["q"]["loo"]["held_out"]
    assert held == [2]  # the middle of the interior layers the pairs span (1, 2)
    for role, path in ROLES.items():
        weights = [a.get(f"model.layers.{i}.{path}.weight") for i in range(4)]
        want, errors = notebook_lesa(weights, role, 5, list(placed), held[0])
        for pair, index in placed.items():
            # within 2e-3 of the largest entry: otdus's SVD (float32 Gram products, float64 eigh)
            # and this float64 SVD give the same subspaces, but singular vectors of nearly equal
            # singular values are rotated against each other by up to eps / gap, which training
            # carries into the prediction (6e-4 for q here, 1e-6 for most types); a wrong formula
            # is off by O(1)
            got = r.get(f"model.layers.{index}.{path}.weight")
            scale = float(want[pair].abs().max())
            assert torch.allclose(got, want[pair], rtol=0, atol=2e-3 * scale), (role, pair)
        info = report["projections"][role]
        assert info["rank"] == min(weights[0].shape[0], 4 * weights[0].shape[1])
        for key, value in errors.items():
            assert info["loo"][key] == pytest.approx(value, rel=1e-4), (role, key)
    # everything LESA does not predict is base layer 0's, bit for bit (the notebook deep-copies layer 0)
    for name in a.names:
        if name.startswith("model.layers.0.") and not any(p in name for p in ROLES.values()):
            suffix = name.removeprefix("model.layers.0.")
            for index in placed.values():
                assert torch.equal(r.get(f"model.layers.{index}.{suffix}"), a.get(name)), suffix


# The published setting on the real stories260K weights, seed 0, every default: numbers recorded from
# this implementation (otdus 0.1.0) so that a change to the computation or the seeding shows; the
# tolerance leaves room for float reassociation (another BLAS build or CPU) only.
PINNED_PUBLISHED = {  # role: (final training loss, held-out error on layer 3, fit error on layer 3)
    "q": (0.00486142, 1.243599, 1.179425),
    "k": (0.00446326, 1.383169, 1.089781),
    "v": (0.00338937, 1.177706, 1.028316),
    "o": (0.0034905, 1.152721, 1.036141),
    "gate": (0.00477989, 1.229254, 1.163919),
    "up": (0.00458217, 1.17926, 1.109606),
    "down": (0.00186193, 1.242622, 1.228378),
}
PINNED_NORMS = {
    "self_attn.q_proj.weight": (10.352733, 10.37016),
    "mlp.down_proj.weight": (11.266839, 11.305976),
}


def test_published_setting_on_a_fixed_seed_is_pinned(tmp_path):
    options = ExpandOptions(method="lesa", seed=0, lesa=LesaOptions(variant="published"))
    result = expand("bundled:stories260k", tmp_path / "out", options)
    report = result.manifest["lesa"]
    for role, (loss, error, fit) in PINNED_PUBLISHED.items():
        info = report["projections"][role]
        assert info["loo"]["held_out"] == [3]
        got = (info["train_loss"], info["loo"]["error"], info["loo"]["fit_error"])
        assert got == pytest.approx((loss, error, fit), rel=1e-3), role
    r = CheckpointReader(tmp_path / "out")
    for name, norms in PINNED_NORMS.items():
        got = tuple(float(r.get(f"model.layers.{i}.{name}").double().norm()) for i in (3, 5))
        assert got == pytest.approx(norms, rel=1e-4), name


def test_published_variant_with_zero_init_is_function_preserving(tiny_models, tmp_path):
    src = tiny_models["qwen2"]  # q/k/v biases: layer 0's in the published variant
    options = ExpandOptions(
        method="lesa", layers=1, zero_init=True, lesa=QUICK.model_copy(update={"variant": "published"})
    )
    result = expand(str(src), tmp_path / "out", options)
    assert result.plan.function_preserving
    assert torch.equal(base_reference(src)[1], logits(load_causal_lm(tmp_path / "out")))
    (lay,) = new_layers(result.manifest)
    bias = "self_attn.q_proj.bias"
    got = CheckpointReader(tmp_path / "out").get(f"model.layers.{lay['index']}.{bias}")
    assert torch.equal(got, CheckpointReader(src).get(f"model.layers.0.{bias}"))


# -- seeds, the check in --json, options ----------------------------------------------------------


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_seeded_and_reproducible_with_the_check_in_the_json_summary(tiny_models, tmp_path):
    src = tiny_models["mistral"]
    common = ["expand", src, "--method", "lesa", "--layers", "2", "--lesa-epochs", "3", "--json"]
    results = {name: run(*common, "--out", tmp_path / name, "--seed", seed) for name, seed in
               (("a", "7"), ("b", "7"), ("c", "8"))}  # fmt: skip
    for result in results.values():
        assert result.exit_code == 0, result.output
    a, b, c = (tmp_path / name / "model.safetensors" for name in "abc")
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    summary = json.loads(results["a"].stdout)
    manifest = json.loads((tmp_path / "a" / "otdus.json").read_text())
    assert summary["lesa"] == manifest["lesa"] and summary["function_preserving"]
    assert manifest["options"]["lesa"]["epochs"] == 3 and manifest["options"]["seed"] == 7
    for role in ("q", "k", "v", "gate", "up"):
        loo = summary["lesa"]["projections"][role]["loo"]
        assert loo["held_out"] == [2] and set(loo["layers"]) == {"2"}
        seconds = summary["lesa"]["projections"][role]["seconds"]
        assert list(seconds) == ["svd", "train", "predict", "loo"] and min(seconds.values()) >= 0
        assert all(0 < loo[k] < 10 for k in ("error", "average_error", "fit_error")), loo
    # without --json the check is said in words, one line per predicted projection
    text = run(
        "expand", src, "--method", "lesa", "--layers", "1", "--lesa-epochs", "1", "--out", tmp_path / "d"
    )
    assert text.exit_code == 0, text.output
    lines = [line for line in text.stdout.splitlines() if line.startswith("LESA ")]
    assert [line.split(":")[0] for line in lines] == ["LESA q", "LESA k", "LESA v", "LESA gate", "LESA up"]
    assert "held-out relative error" in lines[0] and "plain neighbour average" in lines[0]
    # and inspect says it again, from the manifest
    q = summary["lesa"]["projections"]["q"]["loo"]
    shown = run("inspect", tmp_path / "a")
    assert shown.exit_code == 0 and f"q {q['error']:.3f} ({q['average_error']:.3f})" in shown.stdout


def test_average_error_is_the_neighbours_mean_against_the_layer(stories, tmp_path):
    """The reported baseline error, recomputed from the weights themselves."""
    options = ExpandOptions(method="lesa", layers=1, lesa=LesaOptions(epochs=1, loo=3))
    report = expand(str(stories), tmp_path / "out", options).manifest["lesa"]
    a = CheckpointReader(stories)
    for role in ("q", "gate"):
        loo = report["projections"][role]["loo"]
        assert loo["held_out"] == [1, 2, 3]  # 5 layers: every interior layer
        for h in loo["held_out"]:
            w = [a.get(f"model.layers.{i}.{ROLES[role]}.weight").double() for i in (h - 1, h, h + 1)]
            want = float(((w[0] + w[2]) * 0.5 - w[1]).norm() / w[1].norm())
            assert loo["layers"][str(h)]["average_error"] == pytest.approx(want, rel=1e-6)


def test_rank_option_gives_low_rank_new_weights(tiny_models, tmp_path):
    options = ExpandOptions(method="lesa", layers=1, lesa=QUICK.model_copy(update={"rank": 3, "loo": 0}))
    result = expand(str(tiny_models["llama"]), tmp_path / "out", options)
    report = result.manifest["lesa"]
    assert report["loo_skipped"] == "--lesa-loo 0"
    assert all(info["rank"] == 3 for info in report["projections"].values())
    (lay,) = new_layers(result.manifest)
    new_q = CheckpointReader(tmp_path / "out").get(f"model.layers.{lay['index']}.self_attn.q_proj.weight")
    assert int(torch.linalg.matrix_rank(new_q)) == 3


def test_bad_lesa_requests_are_one_error_line(tiny_models, stories, tmp_path):
    from tests.support.cli_checks import no_output_left, one_error_line

    config = json.loads((stories / "config.json").read_text())
    (stories / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
    for zero in ("--zero-init", "--no-zero-init"):  # LESA needs the family's roles
        unknown = run(
            "expand", stories, "--method", "lesa", "--allow-unknown-arch", zero, "--out", tmp_path / "out"
        )
        one_error_line(unknown, message="supports only copy-type methods, not lesa")

    out = tmp_path / "out"
    one_error_line(
        run("expand", "bundled:stories260k", "--method", "lesa", "--lesa-variant", "paper", "--out", out)
    )
    one_error_line(run("expand", "bundled:stories260k", "--method", "lesa", "--lesa-rank", "0", "--out", out),
                   message="--lesa-rank 0")  # fmt: skip
    one_error_line(run("expand", tiny_models["mixtral"], "--method", "lesa", "--out", out), message="MoE")
    no_output_left(tmp_path)


def test_method_spec_and_zero_init_defaults():
    from otdus_cli.expand import make_plan
    from otdus_cli.options import method_spec_options
    from otdus_cli.source import open_source

    spec = method_spec_options("lesa:published")
    assert spec.method == "lesa" and spec.lesa.variant == "published" and spec.zero_init is None
    assert method_spec_options("lesa+nozero").zero_init is False
    source = open_source("bundled:stories260k")
    for options, zero in (
        (spec, False),
        (method_spec_options("lesa"), True),
        (method_spec_options("lesa:published+zero"), True),
    ):
        plan = make_plan(source, options)
        assert [lay.zero_init for lay in plan.layer_map if lay.new] == [zero, zero]
        assert plan.function_preserving == zero


# -- a planted stack: the predictor must recover known layers --------------------------------------


def _rotation(width: int, gen: torch.Generator) -> torch.Tensor:
    """Block-diagonal 2x2 rotations by angles in [0.6, 1.2) rad."""
    q = torch.zeros(width, width, dtype=torch.float64)
    for k, angle in enumerate(
        (torch.rand(width // 2, generator=gen, dtype=torch.float64) * 0.6 + 0.6).tolist()
    ):
        c, s = math.cos(angle), math.sin(angle)
        q[2 * k : 2 * k + 2, 2 * k : 2 * k + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    return q


def planted_llama(folder: Path, depth: int = 8) -> dict[str, list[torch.Tensor]]:
    """A llama whose projections follow known rules across layers (returned, float64, per role):

    * q, k, v, o rotate: W_l = W_0 Q^l (Q block rotations), so W_l = W_{l-1} Q while the plain
      neighbour average 1/2 (W_{l-1} + W_{l+1}) = W_{l-1} (I + Q^2)/2 is cos(angle) times it: only a
      predictor that learned the rule recovers a held-out layer;
    * gate, up, down are affine in depth: W_l = A + l B, so the layer half-way between l and l+1 is
      known, A + (l + 1/2) B.
    hidden = intermediate = 32, so every stacked matrix [W_0 ... W_{L-1}] has full row rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=depth, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(11)
    planted: dict[str, list[torch.Tensor]] = {}
    for role, path in ROLES.items():
        out, width = model.model.layers[0].get_submodule(path).weight.shape
        if role in ("q", "k", "v", "o"):
            q, w = _rotation(width, gen), torch.randn(out, width, generator=gen, dtype=torch.float64) * 0.1
            planted[role] = [w @ torch.linalg.matrix_power(q, layer) for layer in range(depth)]
        else:
            a, b = (torch.randn(out, width, generator=gen, dtype=torch.float64) * 0.1 for _ in range(2))
            planted[role] = [a + layer * 0.5 * b for layer in range(depth)]
            planted[role + ".step"] = [a, 0.5 * b]
        with torch.no_grad():
            for layer, w in enumerate(planted[role]):
                model.model.layers[layer].get_submodule(path).weight.copy_(w)
    model.save_pretrained(folder)
    return planted


def test_planted_stack_the_predictor_recovers_known_layers(tmp_path):
    planted = planted_llama(tmp_path / "src")
    # enough training for 6 x 32 rows (the published 10 epochs of 3 batches would not fit them)
    lesa = LesaOptions(variant="published", epochs=150, hidden=128)
    result = expand(
        str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="lesa", after=[2], lesa=lesa)
    )
    report = result.manifest["lesa"]
    (lay,) = new_layers(result.manifest)
    assert lay["parents"] == [2, 3] and lay["index"] == 3
    a, r = CheckpointReader(tmp_path / "src"), CheckpointReader(tmp_path / "out")

    def relative(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.double() - want).norm() / want.norm())

    for role in ("q", "k", "v", "o"):
        loo, w = report["projections"][role]["loo"], planted[role]
        assert loo["held_out"] == [3]
        average = relative((w[2] + w[4]) * 0.5, w[3])
        assert loo["average_error"] == pytest.approx(average, rel=1e-4) and average > 0.3, role
        # the held-out layer, predicted by a predictor that never saw it, from its neighbours
        assert loo["error"] < 0.15, (role, loo)
    for role in ("gate", "up", "down"):
        a0, step = planted[role + ".step"]
        want = a0 + 2.5 * step  # half-way between base layers 2 and 3
        got = r.get(f"model.layers.3.{ROLES[role]}.weight")
        copy_error = relative(planted[role][2].float(), want)
        # trained on neighbours two apart, applied to adjacent ones (as published): at least twice as
        # close as either neighbour (a wrong pair, block or basis lands at the neighbours' distance or
        # beyond)
        assert copy_error > 0.1 and relative(got, want) < 0.5 * copy_error, (role, relative(got, want))
    # names, shapes and dtypes of the new layer are the source layer's
    prefix = "model.layers.2."
    for name in (n for n in a.names if n.startswith(prefix)):
        got = r.get("model.layers.3." + name.removeprefix(prefix))
        assert got.shape == a.get(name).shape and got.dtype == a.get(name).dtype, name


def test_gram_matrix_keeps_the_smallest_directions_of_an_ill_conditioned_stack():
    """sum_l W_l W_l^T formed with float64 products gives M's singular values to float64 accuracy
    even at condition number 1e4, where float32 products (then summed in float64) put the smallest
    ones off by far more than float32 rounding of the weights themselves."""
    gen = torch.Generator().manual_seed(0)

    def weight(out: int = 48, width: int = 64, cond: float = 1e4) -> torch.Tensor:
        a, _ = torch.linalg.qr(torch.randn(out, out, generator=gen, dtype=torch.float64))
        b, _ = torch.linalg.qr(torch.randn(width, out, generator=gen, dtype=torch.float64))
        s = torch.logspace(0, -math.log10(cond), out, dtype=torch.float64)
        return ((a * s) @ b.T).float()

    weights = [weight() for _ in range(3)]
    want = torch.linalg.svdvals(torch.cat([w.double() for w in weights], dim=1))
    got = torch.linalg.eigvalsh(gram_matrix(weights)).flip(0).clamp(min=0).sqrt()
    assert gram_matrix(weights).dtype == torch.float64
    assert float(((got - want) / want).abs().max()) < 1e-8
