"""A sharded store over two hosts, each with its own disk at the same path (node-local storage).

The hosts are network namespaces on this machine (:mod:`hosts`, root only); torchrun runs
``--nnodes 2 --nproc_per_node 2`` over their veth pair with gloo, so 4 ranks train
``dist_worker.py`` with rank directories 0-1 on host A's disk and 2-3 on host B's. They train as
one process on the whole batches, checkpoint without a file the hosts share and resume exactly; a
whole host SIGKILLed inside a checkpoint leaves every rank reopening at one committed checkpoint,
bit for bit; a host that comes back without its disk makes the open fail, naming the parts. The
resumed job runs under ``horovodrun -H hostA:2,hostB:2`` (ssh into host B: sshd in its namespaces)
and exports onto host B's disk, which serves the rows there. The 4-rank checkpoint reshards across
the hosts to 2 ranks, 3 and 2 again, exactly; and a DeepSpeed job (c10d rendezvous) saves with
``use_node_local_storage`` on each host's disk and resumes to the example.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from dist_worker import ALL_KEYS
from hosts import SSH_PORT, TwoHosts, can_make_hosts, wait_all, wait_for
from test_distributed import BIN, WORKER, _assert_same_training, _env, _full_rows, _load, torchrun

import hierps.serving

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts())),
]

PORT = 29_400 + os.getpid() % 500
TIMEOUT_S = 150
RESUME_WORKER = Path(__file__).with_name("resume_worker.py")


def run_hosts(
    hosts: TwoHosts,
    disks: list[Path],
    out: Path,
    *args: str,
    env: list[dict[str, str]] | None = None,
    ranks: tuple[int, int] = (2, 2),
    worker: str = WORKER,
    c10d: bool = False,
):
    """Run ``WORKER ARGS`` (``dist_worker.py``) as 2 hosts of ``ranks`` ranks each (the store at the
    common path, host A's ranks first); the hosts' processes. Static rendezvous (``--node_rank``),
    or with ``c10d`` torchrun's c10d rendezvous at host A (which numbers A's ranks first)."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for host in (0, 1):
        if c10d:
            where = ["--rdzv_backend=c10d", f"--rdzv_endpoint={hosts.addrs[0]}:{PORT}", "--rdzv_id=hierps"]
        else:
            where = [f"--node_rank={host}", f"--master_addr={hosts.addrs[0]}", f"--master_port={PORT}"]
        argv = [
            str(BIN / "torchrun"),
            "--nnodes=2",
            f"--nproc_per_node={ranks[host]}",
            *where,
            worker,
            *args,
        ]
        extra = env[host] if env else {}
        procs.append(hosts.launch(host, disks[host], argv, {**_env(), **extra}, out / f"host-{host}.log"))
    return procs


def horovod_ready() -> bool:
    """Whether horovodrun can run across the test hosts: Horovod installed, and sshd to reach host B."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return False
    return Path("/usr/sbin/sshd").exists()


def run_horovod(hosts: TwoHosts, disks: list[Path], out: Path, *args: str):
    """Run ``dist_worker.py ARGS --transport horovod`` by ``horovodrun -H hostA:2,hostB:2 --gloo``
    from host A, which reaches host B by ssh (sshd in B's namespaces, B's disk at the common path)."""
    out.mkdir(parents=True, exist_ok=True)
    key, ssh_env = hosts.ssh(out / "ssh", disks)
    cmd = [
        str(BIN / "horovodrun"),
        "-np", "4",
        "-H", f"{hosts.addrs[0]}:2,{hosts.addrs[1]}:2",
        "--gloo",
        "--network-interfaces", hosts.nic,
        "--ssh-port", str(SSH_PORT),
        "--ssh-identity-file", str(key),
        sys.executable, WORKER, *args, "--transport", "horovod",
    ]  # fmt: skip
    return [hosts.launch(0, disks[0], cmd, {**_env(), **ssh_env}, out / "host-0.log")]


def finish(procs, out: Path) -> None:
    codes = wait_all(procs, TIMEOUT_S)
    logs = "\n".join((out / f"host-{h}.log").read_text()[-3000:] for h in range(len(procs)))
    assert codes == [0] * len(procs), f"hosts ended with {codes}:\n{logs}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One process on the whole batches, then 2 hosts x 2 ranks, each checkpointing every pass."""
    base = tmp_path_factory.mktemp("hosts")
    torchrun(1, "train", str(base / "one" / "store"), str(base / "one"), "--every-pass")
    with TwoHosts(base / "common") as hosts:
        disks = [base / "disk-a", base / "disk-b"]
        common = str(hosts.common / "store")
        finish(
            run_hosts(hosts, disks, base / "out", "train", common, str(base / "out"), "--every-pass"),
            base / "out",
        )
    return base


def test_four_ranks_on_two_hosts_train_as_one_process_and_resume(trained, tmp_path):
    """Trained under torchrun; resumed, and exported onto host B's disk, under ``horovodrun -H
    hostA:2,hostB:2`` (torchrun where Horovod or sshd is missing)."""
    ref = _load(trained / "one", "result-0.npz")
    for rank in range(4):
        _assert_same_training(ref, _load(trained / "out", f"result-{rank}.npz"))
    for host, ranks in ((0, (0, 1)), (1, (2, 3))):  # each disk holds its host's ranks, nothing shared
        store = trained / f"disk-{'ab'[host]}" / "store"
        assert sorted(p.name for p in store.iterdir()) == [f"rank-{r:05d}" for r in ranks]
        for r in ranks:
            assert (store / f"rank-{r:05d}" / "commits").is_dir()
    # Resumed at 4 ranks on the same hosts: every row and its optimizer state as trained.
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    for host in (0, 1):
        shutil.copytree(trained / f"disk-{'ab'[host]}", disks[host])
    with TwoHosts(tmp_path / "common") as hosts:
        # Under horovodrun across the hosts where it can run (else torchrun, as the train did).
        args = ["reopen", str(hosts.common / "store"), str(tmp_path), "--export-rank", "2"]
        launch = run_horovod if horovod_ready() else run_hosts
        finish(launch(hosts, disks, tmp_path, *args), tmp_path)
    written = _full_rows(trained / "out", "result", 4, "owned_keys", "owned_rows")
    full = _full_rows(tmp_path, "reopened", 4, "keys", "full")
    assert full.keys() == written.keys()
    for k, v in written.items():
        np.testing.assert_array_equal(full[k], v)
    trained_rows = _load(trained / "out", "result-0.npz")["rows"]
    for rank in range(4):
        got = _load(tmp_path, f"reopened-{rank}.npz")
        np.testing.assert_array_equal(got["rows"], trained_rows)
        assert list(got["tags"]) == ["pass3", "pass4", "final"]
    # Exported by the job onto host B's disk (rank 2's), host A's parts streamed over the link:
    # served there, "pass3" gives the rows of pass 3, and with the delta since it the latest rows.
    assert not (disks[0] / "exports").exists()
    exports = disks[1] / "exports"
    at_pass3 = _full_rows(trained / "out", "pass3", 4, "keys", "rows")
    keys = np.array(sorted(at_pass3))
    with hierps.serving.open(exports / "pass3") as tables:
        want = np.stack([at_pass3[k][: tables.tables["t"]] for k in keys.tolist()])
        np.testing.assert_array_equal(tables.lookup("t", keys), want)
    with hierps.serving.open(exports / "pass3", [exports / "delta"]) as tables:
        np.testing.assert_array_equal(tables.lookup("t", ALL_KEYS), trained_rows)


def test_a_tag_reshards_across_hosts_4_to_2_to_3_to_2_with_one_checkpoint_kept(trained, tmp_path):
    """The 4-rank "final" (parts 0-1 on host A's disk, 2-3 on host B's) loaded at 2 ranks, one a
    host, then at 3 (2 on A, 1 on B), then at 2 again, each keeping one checkpoint: every time each
    new rank's rows, some from parts on the other host's disk, are exactly the ones trained, the tag
    stays loadable, and each new rank's part is on its own host's disk."""
    written = _full_rows(trained / "out", "result", 4, "owned_keys", "owned_rows")
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    for host in (0, 1):
        shutil.copytree(trained / f"disk-{'ab'[host]}", disks[host])
    for i, (world, ranks) in enumerate(((2, (1, 1)), (3, (2, 1)), (2, (1, 1)))):
        out = tmp_path / f"load-{i}"
        with TwoHosts(tmp_path / f"common-{i}") as hosts:
            store = str(hosts.common / "store")
            finish(run_hosts(hosts, disks, out, "load", store, str(out), "--keep", "1", ranks=ranks), out)
        loaded = _full_rows(out, "loaded", world, "keys", "rows")
        assert loaded.keys() == written.keys(), world
        for k, v in written.items():
            np.testing.assert_array_equal(loaded[k], v, err_msg=f"load {i} at {world} ranks, key {k}")
        got = [_load(out, f"loaded-{r}.npz") for r in range(world)]
        assert len({int(g["step"]) for g in got}) == 1
        # The saved tag at 4 ranks and the latest resharded copy of it, on every rank.
        for g in got:
            assert list(g["tags"])[-1] == "final" and list(g["worlds"])[-1] == world, g["tags"]
            assert 4 in list(g["worlds"]), g["worlds"]
        # Each rank's directory is on its own host's disk: the old world's, and the new world's
        # (a new rank of host B writes its part there, beside B's old parts 2-3).
        names = [{p.name for p in (disk / "store").iterdir()} for disk in disks]
        assert names[0] == {"rank-00000", "rank-00001"}, names
        assert names[1] == {f"rank-{r:05d}" for r in (2, 3, *range(ranks[0], world))}, names


def test_deepspeed_with_node_local_storage_saves_on_each_hosts_disk_and_resumes_exactly(tmp_path):
    """``hierps.deepspeed.initialize`` at 4 ranks on 2 hosts (torchrun's c10d rendezvous), DeepSpeed
    saving with ``use_node_local_storage``: each host's disk holds its ranks' store parts and DeepSpeed's files,
    ``latest`` included; the job restarted on the same hosts ``load_checkpoint``s the latest tag from
    each disk and trains every later step as the uninterrupted run did (same examples, bit-equal
    losses), to the same rows and dense parameters."""
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    env = [{"HIERPS_NODE_LOCAL": "1"}] * 2
    for i, name in enumerate(("whole", "resumed")):  # saves at step 12, then trains on to 24
        out = tmp_path / name
        with TwoHosts(tmp_path / f"common-{i}") as hosts:
            argv = [str(hosts.common), "12", "0", name]
            procs = run_hosts(hosts, disks, out, *argv, env=env, worker=str(RESUME_WORKER), c10d=True)
            finish(procs, out)
        if i == 0:
            for host, ranks in ((0, (0, 1)), (1, (2, 3))):
                ckpt = disks[host] / "ckpt"
                assert (ckpt / "latest").read_text().strip() == "s12"
                assert sorted(p.name for p in (ckpt / "s12").glob("hierps-rank-*.json")) == [
                    f"hierps-rank-{r:05d}.json" for r in ranks
                ]
                assert sorted(p.name for p in (disks[host] / "store").iterdir()) == [
                    f"rank-{r:05d}" for r in ranks
                ]
    for rank in range(4):
        whole = json.loads((disks[rank // 2] / f"whole-{rank}.json").read_text())
        resumed = json.loads((disks[rank // 2] / f"resumed-{rank}.json").read_text())
        assert sorted(int(s) for s in resumed["steps"]) == list(range(13, 25)), rank
        assert all(resumed["steps"][s] == whole["steps"][s] for s in resumed["steps"]), rank
        assert resumed["rows"] == whole["rows"] and resumed["dense"] == whole["dense"], rank


HOLDS = [
    # (host killed, where its ranks stop, the checkpoint every rank reopens at)
    (1, "sharded.part_written:1/json.before_replace:1", "pass1"),  # rank 0's record written, B's copies not
    (0, "sharded.before_commit:2", "pass1"),  # every part durable; rank 0 killed before its record
]


@pytest.mark.parametrize(("killed", "hold", "expect"), HOLDS, ids=[f"host{k}-{h}" for k, h, _ in HOLDS])
def test_a_host_killed_inside_a_checkpoint_reopens_every_rank_at_one_checkpoint(
    trained, tmp_path, killed, hold, expect
):
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    out = tmp_path / "out"
    with TwoHosts(tmp_path / "common") as hosts:
        env = [{}, {}]
        env[killed] = {"HIERPS_HOLD": hold}
        store = str(hosts.common / "store")
        procs = run_hosts(hosts, disks, out, "train", store, str(out), "--every-pass", env=env)
        held = [out / f"held-{r}" for r in (2 * killed, 2 * killed + 1)]
        assert wait_for(held[0], procs, TIMEOUT_S) or wait_for(held[1], procs, 5), (
            out / f"host-{killed}.log"
        ).read_text()[-3000:]
        hosts.kill(killed)  # every process of the host, at once
        wait_all(procs, 3)  # the other host's ranks can only wait for the lost peer now: the job
        hosts.kill(1 - killed)  # is stopped there too, as a scheduler would once a host is lost
        wait_all(procs, 30)
    with TwoHosts(tmp_path / "common2") as hosts:  # the job restarted on both hosts
        reopen = tmp_path / "reopen"
        finish(run_hosts(hosts, disks, reopen, "reopen", str(hosts.common / "store"), str(reopen)), reopen)
    got = _full_rows(reopen, "reopened", 4, "keys", "full")
    want = _full_rows(trained / "out", expect, 4, "keys", "rows")
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=f"key {k}")
    for rank in range(4):
        assert list(_load(reopen, f"reopened-{rank}.npz")["tags"])[-1] == expect


def test_a_host_back_without_its_disk_fails_the_open_naming_its_parts(trained, tmp_path):
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    shutil.copytree(trained / "disk-a", disks[0])  # host B comes back with an empty disk
    disks[1].mkdir()
    before = sorted(str(p) for p in disks[0].rglob("*"))
    with TwoHosts(tmp_path / "common") as hosts:
        procs = run_hosts(hosts, disks, tmp_path, "reopen", str(hosts.common / "store"), str(tmp_path))
        codes = wait_all(procs, TIMEOUT_S)
    assert all(c not in (0, None) for c in codes), codes
    for h in (0, 1):  # every rank says which parts are missing, on which ranks
        log = (tmp_path / f"host-{h}.log").read_text()
        assert "part 2 (rank 2: rank-00002" in log and "part 3 (rank 3: rank-00003" in log, log[-3000:]
        assert "MissingPartsError" in log, log[-3000:]
    assert not list(disks[1].rglob("*"))  # nothing created on the empty disk
    assert sorted(str(p) for p in disks[0].rglob("*")) == before  # nothing deleted
