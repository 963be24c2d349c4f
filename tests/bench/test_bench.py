"""python -m onebit.bench: runs, documents its JSON, and finds nothing wrong."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # each runs the bench's own ranks or a fresh interpreter; the fast tier (-m "not slow") leaves these out


ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"size", "count", "type", "backend", "time", "algbw", "busbw", "wire", "speedup", "wrong"}


def bench(*args, launcher=(), timeout=300, env=None):
    cmd = [*launcher, sys.executable, "-m", "onebit.bench", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_two_local_ranks_small_sizes(tmp_path):
    out = bench("--nproc", "2", "-b", "4K", "-e", "64K", "-f", "4", "-w", "1", "-n", "2",
                "--json", str(tmp_path / "r.json"))
    lines = [l for l in out.splitlines() if not l.startswith("#")]
    assert len(lines) == 3 * 3  # sizes 4K, 16K, 64K x (fp32, fp16, compressed)
    assert "# Out of bounds values : 0 OK" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["benchmark"] == "allreduce" and data["config"]["nproc"] == 2
    rows = data["results"]
    assert len(rows) == 9 and all(FIELDS <= set(r) for r in rows)
    assert all(r["wrong"] == 0 for r in rows)
    comp = [r for r in rows if r["backend"] == "compressed"]
    assert [r["count"] for r in comp] == [1024, 4096, 16384]
    # wire bytes: 2(p-1) messages of N/(8p) sign bytes + one 4-byte scale per block of 256
    assert comp[-1]["wire"] == 2 * 1 * (16384 // 2 // 8 + 16384 // 2 // 256 * 4)
    for r in rows:
        assert abs(r["busbw"] - r["algbw"] * 2 * (2 - 1) / 2) < 1e-9


def _table_rows(text):
    return [l for l in text.splitlines() if l.startswith(" ")]


def test_bench_log_with_both_streams_reads_as_a_table():
    """stdout and stderr in one pipe (a log file): no progress bar, no carriage
    returns, and every table row whole on its own line."""
    proc = subprocess.run([sys.executable, "-m", "onebit.bench", "--nproc", "2", "-b", "4K", "-e", "16K",
                           "-w", "0", "-n", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "\r" not in proc.stdout and "it/s" not in proc.stdout, proc.stdout
    rows = _table_rows(proc.stdout)
    assert len(rows) == 3 * 3 and len({len(r.split()) for r in rows}) == 1, rows


def test_bench_on_a_terminal_draws_the_bar_apart_from_the_rows():
    """On a terminal the bar shows, and each row still lands on a line of its own."""
    import pty

    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    # A terminal 100 columns wide: at the new pty's 0 columns tqdm draws nothing.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "onebit.bench", "--nproc", "2", "-b", "4K", "-e", "16K",
                             "-w", "0", "-n", "1"], stdout=follower, stderr=follower, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=300) == 0
    os.close(leader)
    text = b"".join(chunks).decode()
    assert "onebit.bench:" in text  # the bar was drawn
    # What a terminal shows: a carriage return starts the line over.
    shown = [line.rsplit("\r", 1)[-1] for line in text.replace("\r\n", "\n").split("\n")]
    rows = _table_rows("\n".join(shown))
    assert len(rows) == 3 * 3 and len({len(r.split()) for r in rows}) == 1, rows


def test_bench_piece_sizes_give_the_same_bits(tmp_path):
    """Fixed pieces, no pieces and the tuner: all match the float64 simulation
    (which knows nothing of pieces), and the footer names the counts used:
    at most a chunk's blocks (512 here; 8-element pieces were reported as
    32768)."""
    for piece, counts in (("0", "1M:1"), ("4K", "1M:64"), ("8", "1M:512"), ("auto", None)):
        out = bench("--nproc", "2", "-b", "1M", "-e", "1M", "-w", "1", "-n", "2",
                    "--piece-size", piece)
        assert "# Out of bounds values : 0 OK" in out, out
        assert "# pipelined pieces per payload: " + (counts or "1M:") in out, out


def test_bench_wire_format_options_match_their_simulation(tmp_path):
    """--block-size and --scale-dtype, as the optimizers' block_size and
    scale_dtype: 3 ranks, a size that is no multiple of 8 * 3 * 64, rows that
    match the float64 simulation, and the wire bytes of that format."""
    out = bench("--nproc", "3", "-b", "40000", "-e", "40000", "-w", "1", "-n", "2",
                "--block-size", "64", "--scale-dtype", "bfloat16", "--json", str(tmp_path / "w.json"))
    assert "block_size=64 scale_dtype=bfloat16" in out and "# Out of bounds values : 0 OK" in out
    comp = [r for r in json.loads((tmp_path / "w.json").read_text())["results"]
            if r["backend"] == "compressed"]
    chunk = -(-10000 // (64 * 3)) * 64  # N/p, N padded to a multiple of 64 * 3
    assert comp[0]["wire"] == 2 * 2 * (chunk // 8 + chunk // 64 * 2)


def test_count_wrong_allows_one_bf16_ulp_and_nothing_more():
    import torch

    from onebit.bench.reference import count_wrong

    g = torch.Generator().manual_seed(0)
    # What the allreduce gives: a scale in [1, 2) per block of 64, times signs.
    scales = 1 + torch.rand(64, generator=g, dtype=torch.float64)
    signs = torch.randint(0, 2, (64, 64), generator=g).double() * 2 - 1
    expected = (scales[:, None] * signs).reshape(-1)
    server = expected.clone()
    for factor, wrong in ((1 + 2.0 ** -8, 0), (1 + 2.0 ** -6, 64), (-1.0, 64)):
        result = expected.clone()
        result[64:128] *= factor  # one block: a scale one ulp off, four ulps off, signs flipped
        assert count_wrong(result, expected, server, ulp=2.0 ** -7) == wrong, factor
    assert count_wrong(expected * (1 + 2.0 ** -8), expected, server) > 0  # fp32: no ulp allowed


def test_bench_hierarchical_backend_beside_the_flat_one(tmp_path):
    """4 local ranks as 2 nodes of 2: the hierarchical rows match their own
    float64 simulation, and each rank sends a third of the flat bytes over the
    network (its shard among 2 nodes instead of its buffer among 4 ranks)."""
    out = bench("--nproc", "4", "--backend", "compressed,hierarchical", "-b", "64K", "-e", "256K",
                "-f", "4", "-w", "1", "-n", "2", "--json", str(tmp_path / "h.json"),
                env={"ONEBIT_RANKS_PER_NODE": "2"})
    rows = json.loads((tmp_path / "h.json").read_text())["results"]
    assert all(r["wrong"] == 0 for r in rows), out
    flat = {r["count"]: r for r in rows if r["backend"] == "compressed"}
    hier = {r["count"]: r for r in rows if r["backend"] == "hierarchical"}
    assert sorted(hier) == [16384, 65536]
    for count, r in hier.items():
        shard_chunk = count // 2 // 2  # N/K elements, served by M = 2 nodes
        assert r["wire"] == 2 * 1 * (shard_chunk // 8 + shard_chunk // 256 * 4)
        assert flat[count]["wire"] == 3 * r["wire"]
        assert r["node_tx"] is None  # no interface named: loopback
    assert "# pipelined pieces per payload (hierarchical): " in out


def test_probe_fits_the_link_it_is_given():
    """fit_link recovers a latency and bandwidth from times made with them,
    and predict() applies the documented formulas."""
    from onebit.bench.probe import fit_link, predict

    world, latency, bandwidth = 4, 2e-3, 12.5e6  # 100 Mbit/s
    sizes = [1 << 16, 1 << 18, 1 << 20]
    times = [latency + 2 * 3 / 4 * 4 * n / bandwidth for n in sizes]
    got_latency, got_bandwidth = fit_link(sizes, times, world)
    assert abs(got_latency - latency) < 1e-9 and abs(got_bandwidth / bandwidth - 1) < 1e-9
    p = predict(1 << 24, world, latency, bandwidth, compress_per_element=0.0)
    assert abs(p["fp32_s"] - (latency + 1.5 * 4 * (1 << 24) / bandwidth)) < 1e-9
    wire = 1.5 * (1 << 24) * (1 / 8 + 4 / 256) / bandwidth
    assert abs(p["onebit_s"] - (2 * latency + wire)) < 1e-9  # no compute: the wire alone
    assert p["saving_s"] == p["fp32_s"] - p["onebit_s"] > 0


def test_probe_measures_predicts_and_advises(tmp_path):
    out = bench("probe", "--nproc", "2", "--params", "1M", "--iters", "2", "--verify",
                "--verify-iters", "1", "--total-steps", "1000", "--json", str(tmp_path / "p.json"))
    r = json.loads((tmp_path / "p.json").read_text())["result"]
    assert r["latency_s"] >= 0 and r["bandwidth_Bps"] > 0 and r["compress_s_per_element"] > 0
    assert set(r["predicted"]) >= {"fp32_s", "onebit_s", "saving_s"}
    assert r["measured"]["fp32_s"] > 0 and r["measured"]["onebit_s"] > 0
    assert "recommendation: " in out and "freeze_step: 15-25% of the training steps (150..250" in out


def test_step_bench_times_every_setup_against_the_floor(tmp_path):
    out = bench("step", "--nproc", "2", "--params", "300K", "--width", "128", "--steps", "2",
                "--untimed", "1", "--json", str(tmp_path / "s.json"))
    rows = {r["setup"]: r for r in json.loads((tmp_path / "s.json").read_text())["results"]}
    assert list(rows) == ["floor", "ddp+adam", "ddp+fp16", "ddp+powersgd", "onebitadam",
                          "onebitadam+overlap", "zerooneadam", "zerooneadam+overlap", "onebitlamb",
                          "onebitlamb+overlap", "floor again"], out
    assert rows["floor"]["x_floor"] == 1.0 and all(r["seconds"] > 0 for r in rows.values())
    assert rows["floor again"]["bytes_sent"] == 0  # the same no-communication setup, timed last
    assert rows["floor again"]["floor_seconds"] == rows["floor"]["seconds"]
    # Each setup against the floor rounds timed around its own rounds: the
    # first floor round is the floor row, the last the floor-again row.
    floors = [r["floor_seconds"] for r in rows.values()][1:-1]
    assert len(set(floors)) > 1 or len(floors) == 1, floors  # not one floor for every row
    assert rows["ddp+adam"]["floor_seconds"] >= rows["floor"]["seconds"] / 2
    assert rows["onebitlamb+overlap"]["floor_seconds"] >= rows["floor again"]["seconds"] / 2
    for name in ("ddp+adam", "onebitadam", "onebitlamb"):
        r = rows[name]
        assert abs(r["x_floor"] - r["seconds"] / r["floor_seconds"]) < 1e-9
    # Timed in the compression stage: 1-bit traffic, >25x below DDP's fp32 gradients.
    assert rows["onebitadam"]["stage"] == rows["onebitlamb"]["stage"] == "compression"
    assert 0 < rows["onebitadam"]["bytes_sent"] < rows["ddp+adam"]["bytes_sent"] / 25
    # The hooks' baselines: half of fp32's bytes; PowerSGD at rank 4 sends
    # each weight matrix (width x width) as two factors of width x 4.
    assert rows["ddp+fp16"]["bytes_sent"] == rows["ddp+adam"]["bytes_sent"] / 2
    assert rows["ddp+fp16"]["stage"] == "fp16" and rows["ddp+powersgd"]["stage"] == "rank 4"
    assert rows["onebitadam"]["bytes_sent"] < rows["ddp+powersgd"]["bytes_sent"] \
        < rows["ddp+fp16"]["bytes_sent"]
    # overlap_backward changes when the exchange starts, not what it sends.
    for name in ("onebitadam", "zerooneadam", "onebitlamb"):
        twin = rows[name + "+overlap"]
        assert twin["stage"] == rows[name]["stage"] and twin["bytes_sent"] == rows[name]["bytes_sent"]


def test_step_bench_times_diloco_and_streaming_diloco(tmp_path):
    out = bench("step", "--nproc", "2", "--params", "300K", "--width", "128", "--steps", "3",
                "--untimed", "1", "--optimizers", "diloco", "--sync-every", "4", "--fragments",
                "2", "--json", str(tmp_path / "d.json"))
    rows = {r["setup"]: r for r in json.loads((tmp_path / "d.json").read_text())["results"]}
    assert list(rows) == ["floor", "ddp+adam", "ddp+fp16", "ddp+powersgd", "diloco",
                          "diloco+overlap", "floor again"], out
    plain, streaming = rows["diloco"], rows["diloco+overlap"]
    assert plain["stage"] == streaming["stage"] == "1bit"
    # one round of H = 4 steps per timed round: 1 bit of every param per round, not 32 per step
    assert 0 < plain["bytes_sent"] < rows["ddp+adam"]["bytes_sent"] / 64
    # two fragments send what one does, up to each fragment's padding to whole blocks
    assert streaming["bytes_sent"] == pytest.approx(plain["bytes_sent"], rel=0.05)
    assert all(r["seconds"] > 0 for r in rows.values())
    # Timed from the schedule's quiet step: no exchange was still in flight
    # when a timed round ended (plain DiLoCo's are never in flight).
    assert plain["tail"] == streaming["tail"] == "0", out


def test_step_bench_times_diloco_on_the_wire_it_is_given(tmp_path):
    """--diloco-compression sparse2bit: the DiLoCo rows run the sparse wire
    (their stage says so) and send about a quarter of the 1-bit wire's
    bytes (0.22 bits an element at the defaults, against 1.125)."""
    rows = {}
    for wire in ("1bit", "sparse2bit"):
        bench("step", "--nproc", "2", "--params", "300K", "--width", "128", "--steps", "3",
              "--untimed", "1", "--optimizers", "diloco", "--sync-every", "4", "--ddp", "off",
              "--overlap", "off", "--diloco-compression", wire,
              "--json", str(tmp_path / f"{wire}.json"))
        rows[wire] = {r["setup"]: r for r in
                      json.loads((tmp_path / f"{wire}.json").read_text())["results"]}["diloco"]
    assert rows["1bit"]["stage"] == "1bit" and rows["sparse2bit"]["stage"] == "sparse2bit"
    assert 0 < rows["sparse2bit"]["bytes_sent"] < rows["1bit"]["bytes_sent"] / 3


def test_step_bench_on_shards_times_hsdp_and_onebit_over_the_replicas(tmp_path):
    """--shards 2 on 4 ranks: 2 nodes of 2 FSDP2 shards. The baseline is
    HSDP, and what a rank sends to the other node is its shard's: fp32 for
    HSDP, 1 bit (>25x fewer bytes) for the optimizers, and half of what the
    same optimizers send on whole params over 2 ranks."""
    out = bench("step", "--nproc", "4", "--shards", "2", "--params", "300K", "--width", "128",
                "--steps", "2", "--rounds", "1", "--untimed", "1", "--overlap", "off",
                "--optimizers", "onebitadam,diloco", "--sync-every", "2",
                "--json", str(tmp_path / "s.json"))
    rows = {r["setup"]: r for r in json.loads((tmp_path / "s.json").read_text())["results"]}
    assert list(rows) == ["floor", "hsdp+adam", "onebitadam", "diloco", "floor again"], out
    assert "FSDP2 2 nodes x 2 shards" in out
    assert rows["onebitadam"]["stage"] == "compression"
    whole = bench("step", "--nproc", "2", "--params", "300K", "--width", "128", "--steps", "2",
                  "--rounds", "1", "--untimed", "1", "--overlap", "off", "--ddp", "off",
                  "--optimizers", "onebitadam", "--json", str(tmp_path / "w.json"))
    whole_rows = {r["setup"]: r for r in json.loads((tmp_path / "w.json").read_text())["results"]}
    sent = rows["onebitadam"]["bytes_sent"]
    assert 0 < sent < rows["hsdp+adam"]["bytes_sent"] / 25, out
    assert sent == pytest.approx(whole_rows["onebitadam"]["bytes_sent"] / 2, rel=0.05), whole
    assert 0 < rows["diloco"]["bytes_sent"] < sent


def test_step_bench_without_ddp_times_only_the_floor_and_the_optimizers(tmp_path):
    bench("step", "--nproc", "2", "--params", "300K", "--width", "128", "--steps", "1",
          "--rounds", "1", "--untimed", "0", "--optimizers", "diloco", "--sync-every", "2",
          "--fragments", "2", "--overlap", "on", "--ddp", "off", "--json", str(tmp_path / "d.json"))
    rows = [r["setup"] for r in json.loads((tmp_path / "d.json").read_text())["results"]]
    assert rows == ["floor", "diloco+overlap", "floor again"]


def test_step_bench_overlap_choice_names_the_rows():
    from onebit.bench.step import setups

    names = ["onebitadam", "zerooneadam"]
    assert setups(names, "off") == names
    assert setups(names, "on") == ["onebitadam+overlap", "zerooneadam+overlap"]
    assert setups(names, "both") == ["onebitadam", "onebitadam+overlap", "zerooneadam",
                                     "zerooneadam+overlap"]


def test_bench_plot_writes_a_png(tmp_path):
    bench("--nproc", "2", "-b", "4K", "-e", "16K", "-w", "1", "-n", "1", "--plot", str(tmp_path / "bw.png"))
    assert (tmp_path / "bw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_mpi_backend_under_mpirun(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out = bench("--backend", "compressed,mpi", "-b", "16K", "-e", "16K", "-w", "1", "-n", "2",
                "--json", str(tmp_path / "m.json"), launcher=(str(mpiexec), "-n", "3"))
    rows = json.loads((tmp_path / "m.json").read_text())["results"]
    assert {r["backend"] for r in rows} == {"all_reduce", "compressed", "mpi"}
    assert all(r["wrong"] == 0 for r in rows), out


def test_bench_mpi_backend_without_mpirun_says_how():
    proc = subprocess.run([sys.executable, "-m", "onebit.bench", "--nproc", "2", "--backend", "mpi",
                           "-b", "4K", "-e", "4K"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode != 0 and "mpirun -n 4 python -m onebit.bench" in proc.stdout + proc.stderr


def test_kernel_bench_json(tmp_path):
    bench("kernels", "--min-exp", "10", "--max-exp", "11", "-n", "2", "--json", str(tmp_path / "k.json"))
    rows = json.loads((tmp_path / "k.json").read_text())["results"]
    assert [r["n"] for r in rows] == [1024, 2048]
    assert all(r["pack_GBs"] > 0 and r["fused_speedup"] > 0 for r in rows)


def test_local_ranks_use_gloo_without_a_device_per_rank():
    from onebit.accelerator import CpuAccelerator, CudaAccelerator, set_accelerator
    from onebit.launch import local_backend

    class TwoGpus(CudaAccelerator):
        def device_count(self):
            return 2

    try:
        set_accelerator(CpuAccelerator())
        assert local_backend(4) == "gloo"
        set_accelerator(TwoGpus())
        assert local_backend(2) == "nccl"  # a GPU per rank
        assert local_backend(3) == "gloo"  # nccl refuses two ranks on one GPU
    finally:
        set_accelerator(None)


def test_mpirun_jobs_across_machines_default_to_rank_0s_host_name():
    """Under mpirun without MASTER_ADDR, ranks on other machines were sent
    127.0.0.1, their own loopback, and waited out the deadline. Across
    machines the default is now rank 0's host name (one machine: loopback)."""
    import socket

    from onebit.launch import default_master_addr

    assert default_master_addr(spans_nodes=False) == "127.0.0.1"
    assert default_master_addr(spans_nodes=True) == socket.gethostname()


@pytest.mark.parametrize("flags", [
    ["-b", "0"], ["-f", "1", "-i", "0"], ["-f", "1.0001"], ["-f", "0.5"], ["-f", "inf"],
    ["-n", "0"], ["-n", "-3"], ["--nproc", "0"], ["--nproc", "-1"], ["-w", "-1"],
    ["-b", "64K", "-e", "4K"], ["-b", "lots"], ["-e", "4XB"],
    ["kernels", "--min-exp", "12", "--max-exp", "10"], ["kernels", "--min-exp", "3"],
    ["lm", "--freeze", "1.5"],
    ["lm", "--steps", "0"], ["optim", "-n", "0"], ["soak", "--nproc", "0"],
    ["--piece-size", "-1"], ["--piece-size", "many"], ["step", "--params", "0"],
    ["step", "--optimizers", "adamw"], ["step", "--steps", "0"],
    ["step", "--nproc", "3", "--shards", "2", "--overlap", "off"],
    ["lm", "--nproc", "3", "--ranks-per-node", "2"], ["lm", "--ranks-per-node", "0"],
    ["probe", "--params", "0"], ["probe", "--iters", "0"],
    ["time_to_target", "--target-pct", "-1"], ["time_to_target", "--methods", "OnebitAdam"],
    ["time_to_target", "--steps", "0"],
    ["--backend", "compresed"], ["--backend", "compressed,"], ["lm", "--backend", "compresed"],
    ["lm", "--shards", "2", "--only", "DeMo"], ["lm", "--shards", "2", "--inner", "muon"],
    ["lm", "--only", "SparseLoCo", "--diloco-warmup", "0.2"], ["lm", "--inner", "sgd"],
])
def test_bad_bench_flags_are_usage_errors(flags):
    """argparse's usage error and exit status 2, at once: no loop, no traceback."""
    # The research benchmarks moved to the checkout's benchmarks/ and share the flag handling.
    module = (["benchmarks." + flags.pop(0)] if flags[0] in ("lm", "soak", "time_to_target")
              else ["onebit.bench"])
    proc = subprocess.run([sys.executable, "-m", *module, *flags], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, (flags, proc.stdout, proc.stderr)
    assert "usage:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_backend_typo_names_the_known_backends():
    """A misspelt --backend started every rank, and each died in nested
    tracebacks (exit 1); it is now one usage line naming the known names."""
    proc = subprocess.run([sys.executable, "-m", "onebit.bench", "--backend",
                           "hierarchical,compresed"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert "'compresed'" in last and "'compressed'" in last and "'hierarchical'" in last, last
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout


def test_help_lists_every_subcommand_and_no_file_outside_the_package(capsys):
    from onebit.bench.__main__ import COMMANDS, main
    from onebit.bench.command import parser_for

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = out.split("subcommands:")[1].split("\n\n")[0]
    assert [line.split()[0] for line in listed.strip().splitlines()] == list(COMMANDS)
    assert "--block-size" in out  # and the default's flags
    for name, module in COMMANDS.items():
        text = parser_for(module, name).format_help()
        assert "shared/" not in text and "reproduce_readme" not in text, (name, text)


@pytest.mark.parametrize("typo", ["prob", "allreduc", "lm"])
def test_unknown_subcommand_names_the_valid_ones(typo, capsys):
    from onebit.bench.__main__ import main

    assert main([typo]) == 2
    err = capsys.readouterr().err
    assert f"unknown subcommand {typo!r}" in err
    assert "allreduce, kernels, optim, probe, step" in err
    assert ("python -m benchmarks.lm" in err) == (typo == "lm")


def test_sizes_with_unit_suffixes_parse():
    from onebit.bench.table import parse_size

    assert [parse_size(s) for s in ("4KB", "4KiB", "4k", "512B", "1M", "1.5K")] == [
        4096, 4096, 4096, 512, 1 << 20, 1536]


def test_launched_ranks_share_the_cores(monkeypatch):
    import os

    import torch

    from onebit import launch

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * (os.cpu_count() or 1)))
        assert launch.share_cores() == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert launch.share_cores() == (os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)


def test_loss_per_byte_reads_lm_runs_and_plots_them(tmp_path):
    """Two hand-written lm files (H = 4 and an optimizer without H): the
    table's last points are each run's last loss and bytes, labelled by H."""
    runs = {"h4.json": {"config": {"sync_every": 4}, "runs": [
        {"optimizer": "DiLoCo-1bit", "seed": 0, "curve": [[50, 5.5], [100, 4.25]],
         "bytes_sent": [1.0e6, 2.5e6]}]},
            "adam.json": {"config": {"sync_every": 16}, "runs": [
        {"optimizer": "Adam", "seed": 1, "curve": [[50, 5.0], [100, 3.5]],
         "bytes_sent": [2.0e8, 4.0e8]}]}}
    for name, data in runs.items():
        (tmp_path / name).write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.loss_per_byte",
                           str(tmp_path / "h4.json"), str(tmp_path / "adam.json"),
                           "--plot", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]
            if not line.startswith("#")]
    assert rows == [["DiLoCo-1bit", "H=4", "0", "4.2500", "2.500"],
                    ["Adam", "1", "3.5000", "400.000"]]
    # both on the frontier: fewer bytes, or a lower loss
    marks = [line.split() for line in proc.stdout.splitlines()[1:] if line.startswith("# ")
             and not line.startswith("# frontier")]
    assert marks == [["#", "DiLoCo-1bit", "H=4", "4.2500", "2.500", "*"],
                     ["#", "Adam", "3.5000", "400.000", "*"]]
    assert (tmp_path / "p.png").stat().st_size > 1000


def lm_file(tmp_path, name, config, optimizers):
    """A benchmarks.lm --json file of one seed per optimizer, H = 16 and
    `config` over it: what loss_per_byte reads for its labels."""
    data = {"config": {"sync_every": 16, **config}, "runs": [
        {"optimizer": o, "seed": 0, "curve": [[10, 4.0]], "bytes_sent": [1.0e6]}
        for o in optimizers]}
    (tmp_path / name).write_text(json.dumps(data))
    return str(tmp_path / name)


def test_loss_per_byte_labels_the_rows_a_non_default_freeze_moves(tmp_path):
    """A --freeze 0.1 file: the 1-bit and PowerSGD rows carry it in their
    label, apart from the default file's; Adam and the fp16 hook do not."""
    from benchmarks.loss_per_byte import curves

    paths = [lm_file(tmp_path, "f20.json", {"freeze": 0.2}, ["OnebitAdam-bf16warmup", "Adam"]),
             lm_file(tmp_path, "f10.json", {"freeze": 0.1},
                     ["OnebitAdam-bf16warmup", "PowerSGD-r4", "Adam", "Adam-fp16", "DiLoCo-1bit"])]
    assert [r["label"] for r in curves(paths)] == [
        "OnebitAdam-bf16warmup", "Adam", "OnebitAdam-bf16warmup freeze=10%",
        "PowerSGD-r4 freeze=10%", "Adam", "Adam-fp16", "DiLoCo-1bit H=16"]


def test_loss_per_byte_labels_diloco_rows_of_a_non_default_outer_lr(tmp_path):
    """A --outer-lr 1.0 file's DiLoCo rows carry it, apart from the same
    form at the default 1.3 (the frontier averages a label's runs); the
    other rows do not."""
    from benchmarks.loss_per_byte import curves

    paths = [lm_file(tmp_path, "lr13.json", {"outer_lr": 1.3}, ["DiLoCo-bf16"]),
             lm_file(tmp_path, "old.json", {}, ["DiLoCo-bf16"]),
             lm_file(tmp_path, "lr10.json", {"outer_lr": 1.0},
                     ["DiLoCo-bf16", "DiLoCo-fp32", "Adam"])]
    assert [r["label"] for r in curves(paths)] == [
        "DiLoCo-bf16 H=16", "DiLoCo-bf16 H=16", "DiLoCo-bf16 H=16 lr=1", "DiLoCo-fp32 H=16 lr=1",
        "Adam"]


def test_loss_per_byte_labels_diloco_rows_with_a_later_outer_lr(tmp_path):
    """A later outer lr is the 1-bit/2-bit rows' --later-outer-lr and the
    bf16/fp32 rows' --later-outer-lr-full, from --later-from (default 20%);
    a row whose form has none keeps the plain label."""
    from benchmarks.loss_per_byte import curves

    paths = [lm_file(tmp_path, "a.json",
                     {"outer_lr": 1.3, "later_outer_lr": 2.0, "later_outer_lr_full": 1.6},
                     ["DiLoCo-1bit", "DiLoCo-fp32"]),
             lm_file(tmp_path, "b.json",
                     {"outer_lr": 1.0, "later_outer_lr_full": 1.6, "later_from": 0.35},
                     ["DiLoCo-bf16", "DiLoCo-2bit"])]
    assert [r["label"] for r in curves(paths)] == [
        "DiLoCo-1bit H=16 lr=1.3>2@20%", "DiLoCo-fp32 H=16 lr=1.3>1.6@20%",
        "DiLoCo-bf16 H=16 lr=1>1.6@35%", "DiLoCo-2bit H=16 lr=1"]


def test_loss_per_byte_labels_the_sparse_rows_the_anchors_and_muon(tmp_path):
    """The sparse row's constant outer lr, SparseLoCo's lr where it is not
    the published 1.0, DeMo's lr, and Muon as the inner optimizer each
    name their curve apart."""
    from benchmarks.loss_per_byte import curves

    paths = [lm_file(tmp_path, "s.json", {"sparse_outer_lr": 2.0, "sparseloco_lr": 2.0},
                     ["DiLoCo-sparse", "SparseLoCo", "DiLoCo-1bit"]),
             lm_file(tmp_path, "m.json", {"inner": "muon", "sync_every": 64},
                     ["DiLoCo-sparse", "SparseLoCo"]),
             lm_file(tmp_path, "d.json", {"demo_lr": 0.004}, ["DeMo", "Adam"])]
    assert [r["label"] for r in curves(paths)] == [
        "DiLoCo-sparse H=16 lr=2", "SparseLoCo H=16 lr=2", "DiLoCo-1bit H=16",
        "DiLoCo-sparse H=64 muon", "SparseLoCo H=64 muon", "DeMo lr=0.004", "Adam"]


def test_the_frontier_marks_only_points_nothing_beats_for_the_bytes():
    """Worked out by hand: B costs more than A for a higher loss (off);
    C costs more for a lower loss (on); A2 is A's second seed."""
    from benchmarks.loss_per_byte import frontier

    runs = [{"label": "A", "losses": [4.0], "megabytes": [1.0]},
            {"label": "A", "losses": [3.0], "megabytes": [3.0]},
            {"label": "B", "losses": [3.6], "megabytes": [5.0]},
            {"label": "C", "losses": [3.4], "megabytes": [9.0]}]
    assert [(p["label"], p["loss"], p["megabytes"], p["on_frontier"]) for p in frontier(runs)] == [
        ("A", 3.5, 2.0, True), ("B", 3.6, 5.0, False), ("C", 3.4, 9.0, True)]


def test_mean_curves_average_each_labels_seeds_point_by_point():
    from benchmarks.loss_per_byte import mean_curves

    runs = [{"label": "A", "losses": [5.0, 4.0], "megabytes": [1.0, 2.0]},
            {"label": "B", "losses": [6.0], "megabytes": [9.0]},
            {"label": "A", "losses": [3.0, 2.0, 1.0], "megabytes": [1.0, 4.0, 8.0]}]
    assert mean_curves(runs) == [{"label": "A", "losses": [4.0, 3.0], "megabytes": [1.0, 3.0]},
                                 {"label": "B", "losses": [6.0], "megabytes": [9.0]}]


def test_steps_to_target_interpolates_the_first_crossing():
    """Worked out by hand on piecewise-linear curves."""
    from benchmarks.time_to_target import steps_to_target

    down = [(10, 5.0), (20, 4.0), (30, 3.0)]
    assert steps_to_target(down, 3.5) == 25.0
    assert steps_to_target(down, 4.0) == 20.0
    assert steps_to_target(down, 5.0) == 10.0  # already there at the first evaluation
    assert steps_to_target(down, 2.9) is None
    # the first crossing, not the last: 10 + 10 * (5 - 3.5) / (5 - 3)
    assert steps_to_target([(10, 5.0), (20, 3.0), (30, 4.0), (40, 3.2)], 3.5) == 17.5


def test_bytes_by_interpolates_from_nothing_sent_at_step_0():
    from benchmarks.time_to_target import bytes_by

    curve = [(10, 5.0), (20, 4.0)]
    assert bytes_by(curve, [100.0, 300.0], 5) == 50.0
    assert bytes_by(curve, [100.0, 300.0], 15) == 200.0
    assert bytes_by(curve, [100.0, 300.0], 20) == 300.0


def test_seconds_by_counts_a_fractional_step_by_its_share():
    from benchmarks.time_to_target import seconds_by

    assert seconds_by([1.0, 2.0, 3.0, 4.0], 2.5) == 1.0 + 2.0 + 0.5 * 3.0
    assert seconds_by([1.0, 2.0, 3.0, 4.0], 4) == 10.0
    assert seconds_by([1.0, 2.0], 0) == 0.0


def test_time_to_target_rows_against_the_fp16_hook_worked_by_hand():
    """Adam ends at 4.0, so the target at 2% is 4.08. Each curve crosses it
    where worked out below; the fp16 hook's time is the mean of its two
    rows, 3.0 s; a method that never gets there has no time."""
    from benchmarks.time_to_target import summarise

    def run(name, curve, seconds, sent=(4.0e6, 8.0e6)):
        return {"optimizer": name, "curve": curve, "final": curve[-1][1], "step_seconds": seconds,
                "bytes_sent": list(sent)}

    runs = [run("Adam-fp16", [(2, 5.0), (4, 4.0)], [1.0, 1.0, 1.0, 1.0]),       # at 3.84: 3.84 s
            run("Adam", [(2, 5.0), (4, 4.0)], [2.0] * 4),                        # 3.84 steps: 7.68 s
            run("OnebitAdam", [(2, 4.08), (4, 3.5)], [0.25, 0.25, 0.5, 0.5],    # at 2: 0.5 s
                (1.0e6, 1.5e6)),
            run("PowerSGD-r4", [(2, 5.0), (4, 4.5)], [0.1] * 4),                 # never
            run("Adam-fp16 again", [(2, 5.0), (4, 4.0)], [0.5, 0.5, 0.75, 1.0])]  # 2.16 s
    target, rows = summarise(runs, 2.0, freeze_step=1)
    assert target == pytest.approx(4.08)
    by = {r["method"]: r for r in rows}
    assert by["Adam-fp16"]["steps"] == pytest.approx(3.84)
    assert by["Adam-fp16"]["seconds"] == pytest.approx(3.84)
    assert by["Adam-fp16 again"]["seconds"] == pytest.approx(0.5 + 0.5 + 0.75 + 0.84 * 1.0)
    against = (3.84 + 2.59) / 2
    assert by["Adam"]["seconds"] == pytest.approx(7.68)
    assert by["Adam"]["x_fp16"] == pytest.approx(against / 7.68)
    assert by["OnebitAdam"]["steps"] == 2.0 and by["OnebitAdam"]["seconds"] == 0.5
    assert by["OnebitAdam"]["x_fp16"] == pytest.approx(against / 0.5)
    assert by["PowerSGD-r4"]["steps"] is None and by["PowerSGD-r4"]["x_fp16"] is None
    # bytes by the target: 4 MB at step 2, 8 MB at 4, so 4 + 4 * 0.92 at 3.84
    assert by["Adam-fp16"]["megabytes"] == pytest.approx(4.0 + 4.0 * 0.92)
    assert by["OnebitAdam"]["megabytes"] == pytest.approx(1.0)
    assert by["OnebitAdam"]["bytes_x_fp16"] == pytest.approx(7.68)
    assert by["PowerSGD-r4"]["megabytes"] is None and by["PowerSGD-r4"]["bytes_x_fp16"] is None
    assert by["OnebitAdam"]["seconds_per_step"] == pytest.approx(0.375)
    assert by["OnebitAdam"]["seconds_per_step_to_freeze"] == pytest.approx(0.25)
    assert by["OnebitAdam"]["seconds_per_step_after"] == pytest.approx(1.25 / 3)
    assert [r["method"] for r in rows] == [r["optimizer"] for r in runs]


@pytest.mark.slow
def test_time_to_target_runs_the_lm_training_and_times_every_step(tmp_path):
    """Two local ranks, 8 steps (4 of them OnebitAdam's warmup: fewer leave
    it with too poor a variance to stay finite): each run times all 8 steps; each row's
    time is the run's own clock at the crossing, found again here with
    numpy on a fine grid of the curve and the cumulative step times."""
    out = tmp_path / "ttt.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.time_to_target", "--steps", "8",
                           "--freeze", "0.5", "--every", "2", "--nproc", "2", "--methods", "Adam", "OnebitAdam",
                           "--target-pct", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["optimizer"] for r in data["runs"]] == ["Adam-fp16", "Adam", "OnebitAdam",
                                                      "Adam-fp16 again"]
    adam = next(r for r in data["runs"] if r["optimizer"] == "Adam")
    assert data["target"] == pytest.approx(adam["final"] * 1.03)
    for run, row in zip(data["runs"], data["results"]):
        assert len(run["step_seconds"]) == 8 and min(run["step_seconds"]) > 0
        steps = np.array([0.0] + [s for s, _ in run["curve"]])
        grid = np.linspace(run["curve"][0][0], 8, 600001)
        loss = np.interp(grid, steps[1:], [x for _, x in run["curve"]])
        hit = grid[np.argmax(loss <= data["target"])] if (loss <= data["target"]).any() else None
        if hit is None:
            assert row["seconds"] is None
            continue
        clock = np.interp(hit, np.arange(9), np.concatenate([[0.0], np.cumsum(run["step_seconds"])]))
        assert row["steps"] == pytest.approx(hit, abs=1e-4)
        assert row["seconds"] == pytest.approx(clock, rel=1e-3)
