"""Runs the real trainer with REFT and checks, for every snapshot, that the bytes the
chosen schedule committed are exactly an end-of-iteration snapshot of the same
iteration: right after each optimizer step (the moment an end-of-iteration snapshot is
taken) the probe checksums the state straight from the source tensors, with a code path
independent of the snapshot's chunk units (streaming checksum over the layout, the
protection's encoder into a scratch buffer), and compares when the snapshot commits.
Prints one [HAS-CHECK] line per rank."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.training import Trainer  # noqa: E402
from reft_ext.checksum import checksum  # noqa: E402


class Check:
    def __init__(self, trainer):
        self.snap = trainer.reft.snap
        self.expected, self.compared, self.how = {}, 0, {"bubble": 0, "compute": 0,
                                                         "drain": 0}

    def _reference(self):
        s = self.snap
        lay = s.layout
        start, end = lay.slice_range(s.member)
        red = torch.empty(s.regions["redundancy"][1], dtype=torch.uint8)
        s.protection.encode(lay, red)
        out = {"own": lay.replicated.checksum(start, end), "redundancy": checksum(red),
               "owned": lay.owned.checksum(0, lay.owned.nbytes), "aor": checksum(b"")}
        if s.aor is not None:
            s.aor.wait()
            out["aor"] = checksum(s.aor.replica.buffer)
        return out

    def after_step(self, state):  # runs after ReftHook.after_step handed the copy over
        self.expected[state.iteration] = self._reference()
        self._compare()

    def on_exit(self, state):
        self._compare()

    def _compare(self):
        last = self.snap.last
        it = last.get("iteration")
        if it in self.expected:
            exp = self.expected.pop(it)
            assert last["sums"] == exp, f"iteration {it}: {last['sums']} != {exp}"
            self.compared += 1
            for k in self.how:
                self.how[k] += last[k]


def main():
    args = parse_args(sys.argv[1:])
    trainer = Trainer(args)
    check = Check(trainer)
    trainer.hooks.append(check)   # after ReftHook (inserted first)
    trainer.train()
    print(f"[HAS-CHECK] rank {torch.distributed.get_rank()} identical {check.compared} "
          f"bubble {check.how['bubble']} compute {check.how['compute']} "
          f"drain {check.how['drain']}", flush=True)


if __name__ == "__main__":
    main()
