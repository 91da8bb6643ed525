"""The training jobs: a few steps of jobs.train in-process on every world size, and the
pieces they are made of (codec list, shards, backprop) in one process."""

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import world
from jobs import _compare, _mlp
from jobs._data import ShardSampler, batch_split, load_digits, local_batch_size

N_PARAMS = 64 * 128 + 128 + 128 * 10 + 10  # the default MLP 64-128-10


def _results(path):
    with open(path / "results.json") as f:
        return {r["label"]: r for r in json.load(f)["runs"]}


@pytest.mark.mpi
class TestTrainJob:
    def test_codecs_train_and_report(self, shared_dir):
        from jobs import train

        labels = ["none", "qsgd_maxnorm_bits4", "threelc_sparsity1.0"]
        argv = ["--steps", "20", "--codecs", ",".join(labels), "--out", str(shared_dir)]
        assert train.main(argv) == 0
        runs = _results(shared_dir)
        assert list(runs) == labels

        base = runs["none"]
        losses = np.array(base["losses"])
        assert base["loss_steps"] == list(range(21))
        assert np.all(np.isfinite(losses))
        # SGD from a fresh start: the whole-training-set loss falls, and keeps falling
        assert losses[-1] < losses[10] < losses[0]
        assert losses[-1] < 0.5 * losses[0]
        assert base["test_accuracy"] > 0.5
        for r in runs.values():
            assert r["diverged"] == 0
            assert r["final_train_loss"] == r["losses"][-1] < r["losses"][0]

        # bytes the collectives reported: float32 moves at least 4 bytes per parameter,
        # 4-bit codes less, 3LC's trits (1.6 bits or less) far less; one rank sends nothing
        from mpi4py import MPI

        if MPI.COMM_WORLD.size == 1:
            assert all(r["bytes_sent"] == 0 for r in runs.values())
            return
        assert base["bytes_sent"] >= 4 * N_PARAMS
        assert runs["qsgd_maxnorm_bits4"]["bytes_sent"] < base["bytes_sent"] / 2
        assert runs["threelc_sparsity1.0"]["bytes_sent"] < base["bytes_sent"] / 10

        assert (shared_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if _compare.supports_trace():
            import h5py

            for label in labels:
                assert h5py.is_hdf5(shared_dir / f"{label}.h5")

    def test_divergence_is_reported_not_raised(self, shared_dir):
        from jobs import train

        argv = ["--steps", "8", "--lr", "1e6", "--codecs", "none,qsgd_maxnorm_bits4"]
        argv += ["--out", str(shared_dir), "--no-trace", "--no-plot"]
        assert train.main(argv) == 0
        for r in _results(shared_dir).values():
            assert r["diverged"] in range(1, 9)

    def test_torch_job_trains_and_overlap_changes_nothing(self, shared_dir):
        if world().size > 2:
            pytest.skip("the torch job is checked at 1 and 2 ranks (importing torch is slow)")
        pytest.importorskip("torch")
        from jobs import train_torch

        argv = ["--steps", "6", "--codecs", "none,signsgd", "--overlap", "both", "--no-plot"]
        assert train_torch.main(argv + ["--out", str(shared_dir)]) == 0
        runs = _results(shared_dir)
        assert list(runs) == [
            "none_overlap",
            "none_no-overlap",
            "signsgd_overlap",
            "signsgd_no-overlap",
        ]
        for r in runs.values():
            assert r["overlap"] == r["label"].endswith("_overlap")
            assert r["diverged"] == 0
            assert r["loss_steps"] == list(range(7))
            assert np.all(np.isfinite(r["losses"]))
            # data-parallel SGD: every rank ends with rank 0's weights, bit for bit
            assert r["weight_spread"] == 0.0
        for codec in ("none", "signsgd"):
            on, off = runs[f"{codec}_overlap"], runs[f"{codec}_no-overlap"]
            # the same reductions of the same buckets, only started earlier
            assert on["losses"] == off["losses"]
            assert on["test_accuracy"] == off["test_accuracy"]
            assert on["bytes_sent"] == off["bytes_sent"]
        base = runs["none_overlap"]["losses"]
        assert base[-1] < base[3] < base[0]
        if world().size == 2:
            n_params = 9978  # jobs._cnn.make_cnn's parameters
            assert runs["none_overlap"]["bytes_sent"] >= 4 * n_params
            assert runs["signsgd_overlap"]["bytes_sent"] < runs["none_overlap"]["bytes_sent"] / 10
        if _compare.supports_trace():
            import h5py

            assert all(h5py.is_hdf5(shared_dir / f"{label}.h5") for label in runs)

        # divergence is reported, not raised
        argv = ["--steps", "4", "--lr", "1e20", "--codecs", "none", "--no-plot", "--no-trace"]
        assert train_torch.main(argv + ["--out", str(shared_dir / "div")]) == 0
        assert _results(shared_dir / "div")["none"]["diverged"] in range(1, 5)


class TestPieces:
    def test_parse_runs(self):
        assert _compare.parse_runs(None) == _compare.RUNS
        assert [r.label for r in _compare.parse_runs("qsgd_maxnorm")] == [
            "qsgd_maxnorm_bits8",
            "qsgd_maxnorm_bits4",
            "qsgd_maxnorm_bits2",
        ]
        (run,) = _compare.parse_runs("threelc:sparsity=1.25")
        assert (run.codec, run.params, run.label) == (
            "threelc",
            {"sparsity": 1.25},
            "threelc_sparsity1.25",
        )
        (run,) = _compare.parse_runs(" signsgd:tie=negative ,")
        assert run.params == {"tie": "negative"}
        runs = _compare.parse_runs("qsgd_maxnorm_multiscale:bits=2:scales=(2,8),none")
        assert [r.label for r in runs] == ["qsgd_maxnorm_multiscale_bits2_scales2-8", "none"]
        assert runs[0].params == {"bits": 2, "scales": (2, 8)}
        assert _compare.parse_runs("grandk_maxnorm_multiscale")[0].params == {}
        with pytest.raises(ValueError, match="key=value"):
            _compare.parse_runs("threelc:1.5")
        with pytest.raises(ValueError, match="no codec"):
            _compare.parse_runs(" , ")

    def test_demo_and_tour_cover_every_codec(self):
        import mpicomp
        from jobs import codec_tour, train

        available = set(mpicomp.codecs.available())
        demo = _compare.parse_runs(train.CODECS)
        assert {r.codec for r in demo} == available
        assert [r.label for r in demo[: len(_compare.RUNS)]] == [r.label for r in _compare.RUNS]
        for r in demo:  # what the job builds before any rank trains
            mpicomp.codec(r.codec, **r.params)
        assert {name for name, _ in codec_tour.TOUR} == available

    def test_digest_covers_every_codec_and_schedule_on_one_rank(self):
        from mpi4py import MPI

        import mpicomp
        from jobs import digest
        from mpicomp.reduction import schedule_names

        out = digest.digests(MPI.COMM_SELF, numel=256, steps=1)
        flat = {
            f"{name}/{s}"
            for name in mpicomp.codecs.available()
            for s in schedule_names(mpicomp.codec(name))
            if s != "auto" and not s.startswith("hier:")  # hosts of two need 4 ranks
        }
        assert {k.removesuffix("/no feedback") for k in out} == flat
        assert {k for k in out if k.endswith("/no feedback")} == {
            f"{name}/{s}/no feedback"
            for name in digest.FEEDBACK
            for s in ("allgather", "sharded", "float32")
        }
        assert all(len(v) == 16 and int(v, 16) >= 0 for v in out.values())
        # On one rank the average is the input: every uncompressed path agrees, top-k does not.
        assert out["none/allreduce"] == out["fp16/float32"] == out["signsgd/float32"]
        assert out["topk/allgather"] != out["none/allreduce"]
        again = digest.digest(MPI.COMM_SELF, "topk", "allgather", 256, 1)
        assert again == out["topk/allgather"]

    def test_tour_prints_a_row_per_entry(self, capsys):
        from jobs import codec_tour

        assert codec_tour.main(["--reps", "1"]) == 0
        lines = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
        rows = lines[start : start + len(codec_tour.TOUR)]
        n, m = 512, 512 * 3 * 3  # the tour's gradient as a matrix of shape[0] rows
        for (name, params), row in zip(codec_tour.TOUR, rows, strict=True):
            cells = row.split()
            assert cells[0] == name
            bits, err = float(cells[-7]), float(cells[-5])
            assert np.isfinite(err) and err >= 0
            if name == "none":
                assert (bits, err) == (32.0, 0.0)
            elif name == "powersgd":  # its float32 factors P (n x r) and Q (m x r)
                assert bits == pytest.approx(32 * (n + m) * params["rank"] / (n * m), abs=1e-3)
            else:
                assert bits < 32
        assert lines[start + len(codec_tour.TOUR)].startswith("bits/elem:")

    def test_batch_split_names_the_ranks_parts(self):
        assert batch_split(64, 2) == "32"
        assert batch_split(64, 3) == "21-22"
        assert batch_split(5, 5) == "1"

    def test_interleave_steps_every_active_trainer_in_turn(self):
        from jobs._loop import interleave

        log = []

        class Trainer:
            def __init__(self, label, diverges_at=None):
                self.result = SimpleNamespace(label=label, diverged=0)
                self.loss, self.diverges_at = 1.0, diverges_at
                log.append(f"build {label}")

            @property
            def active(self):
                return not self.result.diverged

            def close_on(self, stack):
                stack.callback(log.append, f"close {self.result.label}")

            def step(self, step):
                log.append(f"{self.result.label} {step}")
                if step == self.diverges_at:
                    self.result.diverged = step + 1

            def finish(self):
                log.append(f"finish {self.result.label}")
                return self.result.label

        said = []
        done = interleave((Trainer("a"), Trainer("b", diverges_at=1)), 3, said.append)
        assert done == ["a", "b"]
        assert log == [
            "build a", "build b", "a 0", "b 0", "a 1", "b 1", "a 2",
            "close b", "close a", "finish a", "finish b",
        ]  # fmt: skip
        # every quarter of the steps (here every step) the batch losses of those still active
        assert said[1] == "  b: diverged at step 2 (NaN/Inf)"
        progress = [line for line in said if line.startswith("step ")]
        assert [line[:8] for line in progress] == ["step 1/3", "step 2/3", "step 3/3"]
        losses = [line.split("batch loss on rank 0: ")[1] for line in progress]
        assert losses == ["a 1, b 1", "a 1", "a 1"]

        # a trainer that cannot be built: those built before close, nothing steps
        def trainers():
            yield Trainer("c")
            raise RuntimeError("no comm")

        log.clear()
        with pytest.raises(RuntimeError, match="no comm"):
            interleave(trainers(), 3, said.append)
        assert log == ["build c", "close c"]

    def test_report_helpers(self, capsys):
        import argparse

        from jobs._report import parse, print_table, usage_errors

        print_table("ab  c", iter(["1   2", "3   4"]))
        assert capsys.readouterr().out == "ab  c\n-----\n1   2\n3   4\n"
        ap = argparse.ArgumentParser(prog="jobs.x")
        args = parse(ap, ["--json"], 3, "timed calls")
        assert (args.reps, args.json) == (3, True)
        with pytest.raises(SystemExit) as e:
            parse(argparse.ArgumentParser(prog="jobs.x"), ["--reps", "0"], 3, "timed calls")
        assert e.value.code == 2
        assert "jobs.x: error: --reps must be >= 1, got 0" in capsys.readouterr().err
        with pytest.raises(SystemExit), usage_errors(ap):
            raise ValueError("not a count: 'x'")
        assert "jobs.x: error: not a count: 'x'" in capsys.readouterr().err
        with pytest.raises(TypeError), usage_errors(ap):  # only the errors named
            raise TypeError("a bug")

    @pytest.mark.parametrize("size", [1, 2, 3, 5])
    def test_shards_split_the_training_set_and_the_batch(self, size):
        batch, n = 37, 101
        samplers = [ShardSampler(n, batch, r, size, seed=3) for r in range(size)]
        assert sum(s.local for s in samplers) == batch
        assert sorted(np.concatenate([s.shard for s in samplers]).tolist()) == list(range(n))
        for s in samplers:
            assert s.local == local_batch_size(batch, samplers.index(s), size)
            seen = np.concatenate([s.next() for _ in range(s.shard.size // s.local)])
            # one epoch of its own shard: no repeats, nothing from another rank
            assert len(set(seen.tolist())) == seen.size
            assert set(seen.tolist()) <= set(s.shard.tolist())
        with pytest.raises(ValueError, match="batch"):
            ShardSampler(n, 2, 0, 3, seed=0)

    def test_backprop_matches_finite_differences(self):
        data = load_digits()
        assert data.x_train.shape == (1437, 64) and data.x_test.shape == (360, 64)
        assert np.allclose(data.x_train.mean(axis=0), 0, atol=1e-5)
        params = {k: v.astype(np.float64) for k, v in _mlp.init_mlp([64, 9, 7, 10], 1).items()}
        x, y = data.x_train[:6].astype(np.float64), data.y_train[:6]
        loss, grads = _mlp.loss_and_grads(params, x, y, scale=2.0)
        assert loss == pytest.approx(_mlp.loss(params, x, y))
        eps = 1e-6
        for name, p in params.items():
            i = np.unravel_index(np.argmax(np.abs(grads[name])), p.shape)
            p[i] += eps
            up = _mlp.loss(params, x, y)
            p[i] -= 2 * eps
            down = _mlp.loss(params, x, y)
            p[i] += eps
            assert grads[name][i] == pytest.approx(2.0 * (up - down) / (2 * eps), rel=1e-4)

    def test_bad_options(self):
        from jobs import train

        for argv, match in [
            (["--steps", "0"], "--steps"),
            (["--lr", "-1"], "--lr"),
            (["--hidden", "64,x"], "--hidden"),
            (["--momentum", "1"], "--momentum"),
        ]:
            with pytest.raises(ValueError, match=match):
                train.main(argv + ["--no-plot", "--no-trace"])

    def test_torch_job_without_torch_says_so(self, monkeypatch, capsys):
        from jobs import train_torch

        monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
        assert train_torch.main(["--steps", "1"]) == 2
        assert "pip install 'mpicomp[torch]'" in capsys.readouterr().err
