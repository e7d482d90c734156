"""One node's part of an in-process job across nodes (started once per node by srun:
examples/slurm/launch_node.sh with ``RESTART=in-process``).

    python -m reft_ext.cluster.node_agent --store HOST:PORT --node N --host NAME \\
        --workers W --world-size WS --ranks-per-node P --job-id J -- SCRIPT [ARGS...]

It starts ``W`` warm workers on this node (reft_ext/cluster/spare.py: imports done,
waiting for an assignment from the coordinator), registers the node in the job's store
(``node/<N>``), beats ``hb/<N>`` every ``HEARTBEAT_S`` s, reports each worker's end
(``exit/<N>.<k>``, the code) the moment it happens, and carries out the coordinator's
commands (``cmd/<N>/<i>``: spawn more workers, kill a frozen one, stop). Everything it
writes and reads is signed with the job's secret (``$REFT_INPROCESS_SECRET``, which the
batch script made and srun handed to every task). It waits on the store rather than
polling it: a blocked ``wait`` for the next command, bounded by the heartbeat.

If the job's store is unreachable (the coordinator's node is lost, or the job ends
without a stop), the agent stops its workers, says so in one line, and exits 1: the
job is over, and Slurm's requeue or a resubmission resumes it (docs/nodes.md).
"""

from __future__ import annotations

import os

# the store waits that time out print two c10d warnings each: this process waits that
# way by design (before torch is imported; the workers get the caller's setting back)
_CPP_LOG = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from reft_ext.cluster.inprocess import job_secret, key, notify, read_signed, sign  # noqa: E402
from reft_ext.cluster.node_pool import HEARTBEAT_S, wid_of  # noqa: E402
from reft_ext.cluster.pool import worker_command  # noqa: E402
from reft_ext.cluster.supervisor import DEFAULT_PRELOAD  # noqa: E402


class Agent:
    def __init__(self, a, script: list[str]):
        self.a, self.script = a, script
        self.secret = job_secret()
        host, port = a.store.rsplit(":", 1)
        self.store = torch.distributed.TCPStore(
            host, int(port), is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=a.connect_timeout))
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env.pop("TORCH_CPP_LOG_LEVEL")
        if _CPP_LOG is not None:
            self.env["TORCH_CPP_LOG_LEVEL"] = _CPP_LOG

    def say(self, msg: str) -> None:
        print(f"[inprocess] node {self.a.node} ({self.a.host}): {msg}", flush=True)

    def _set(self, k: str, value: str, gen: int = 0) -> None:
        self.store.set(k, sign(self.secret, k, value, gen))

    # ---- workers -------------------------------------------------------------------
    def spawn(self, count: int) -> None:
        a = self.a
        for _ in range(count):
            with self.lock:
                wid = wid_of(a.node, self.started)
                self.started += 1
                cmd = worker_command(a.store, wid, a.world_size, a.ranks_per_node, a.job_id,
                                     a.preload, self.script[0], self.script[1:])
                self.procs[wid] = p = subprocess.Popen(cmd, env=self.env,
                                                       start_new_session=True)
            threading.Thread(target=self._reap, args=(wid, p), daemon=True,
                             name=f"reap-{wid}").start()

    def _reap(self, wid: str, p: subprocess.Popen) -> None:
        code = p.wait()
        if self.stopping.is_set():
            return
        self.say(f"worker {wid} (pid {p.pid}) exited with {code}")
        try:
            self._set(key("exit", wid), str(code))
            notify(self.store, f"exit {wid}")
        except Exception:  # noqa: BLE001 - the store is gone: the main loop says so
            pass

    def kill(self, wid: str, sig: int) -> None:
        p = self.procs.get(wid)
        if p is not None and p.poll() is None:
            self.say(f"killing worker {wid} (pid {p.pid}) with signal {sig}, as the "
                     f"coordinator asked")
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

    def stop_all(self, sig: int = signal.SIGKILL, grace: float = 0.0) -> None:
        self.stopping.set()
        for p in list(self.procs.values()):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        for p in list(self.procs.values()):
            try:
                p.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # ---- the loop ------------------------------------------------------------------
    def run(self) -> int:
        a = self.a
        self.spawn(a.workers)
        self._set(key("node", a.node), json.dumps({"host": a.host, "pid": os.getpid(),
                                                   "workers": a.workers}))
        notify(self.store)
        self.say(f"{a.workers} warm worker(s) started; store {a.store}")
        beat, i = 0, 1
        next_beat = 0.0
        while True:
            try:
                if time.monotonic() >= next_beat:
                    beat += 1
                    self._set(key("hb", a.node), str(beat))
                    next_beat = time.monotonic() + HEARTBEAT_S
                k = key("cmd", a.node, i)
                try:
                    self.store.wait([k], datetime.timedelta(
                        seconds=max(0.01, next_beat - time.monotonic())))
                except torch.distributed.DistStoreError:
                    continue  # the heartbeat's turn
                raw = read_signed(self.store, self.secret, k, i)
                if raw is None:  # forged (warned once): the coordinator's value for
                    time.sleep(0.05)  # this index overwrites it; look again, heartbeat on
                    continue
                i += 1
                cmd = json.loads(raw)
            except Exception as exc:  # noqa: BLE001 - the coordinator is gone
                if self.stopping.is_set():
                    return 0
                self.say(f"the job's store at {a.store} is unreachable ({type(exc).__name__}:"
                         f" {str(exc).splitlines()[0][:120]}): the coordinator's node is "
                         f"lost or the job ended; stopping this node's workers")
                self.stop_all(signal.SIGKILL)
                return 1
            if cmd.get("op") == "ping":  # beat now: the coordinator is deciding
                next_beat = 0.0
            elif cmd.get("op") == "spawn":
                self.spawn(int(cmd.get("count", 1)))
            elif cmd.get("op") == "kill":
                self.kill(str(cmd.get("wid")), int(cmd.get("sig", signal.SIGKILL)))
            elif cmd.get("op") == "stop":
                self.say("stopping the workers, as the coordinator asked (the job is over, "
                         "or this node was given up)")
                self.stop_all(signal.SIGTERM, grace=10)
                return 0

    def terminate(self, signum, frame) -> None:
        """Slurm's SIGTERM (time limit, scancel): the ranks get it too (the trainer's
        exit-signal handling); this agent waits for them."""
        self.say("SIGTERM: passing it to the workers")
        for p in list(self.procs.values()):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="HOST:PORT of the coordinator's store")
    p.add_argument("--node", type=int, required=True, help="this node's index (SLURM_NODEID)")
    p.add_argument("--host", required=True, help="this node's name (for the log)")
    p.add_argument("--workers", type=int, required=True,
                   help="workers to start at once (ranks per node + warm spares)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--job-id", default=os.environ.get("REFT_JOB_ID", ""),
                   help="REFT's job id (default: $REFT_JOB_ID: not on a command line)")
    p.add_argument("--preload", default=DEFAULT_PRELOAD)
    p.add_argument("--connect-timeout", type=float, default=300.0)
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not a.job_id:
        p.error("--job-id (or REFT_JOB_ID in the environment) is required")
    if not rest:
        p.error("give the training script after '--'")
    agent = Agent(a, rest)
    signal.signal(signal.SIGTERM, agent.terminate)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
