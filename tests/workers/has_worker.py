"""Runs the real trainer with REFT and checks, for every snapshot, that the bytes the
chosen schedule committed are exactly an end-of-iteration snapshot of the same
iteration: right after each optimizer step (the moment an end-of-iteration snapshot is
taken) the probe checksums the state straight from the source tensors, with a code path
independent of the snapshot code (its own concatenation, padding, replica and XOR
parity from the raw bytes; neither StateLayout nor the protection's encoder), and
compares when the snapshot commits.
Prints one [HAS-CHECK] line per rank."""

import sys


import torch

from megatron.training.arguments import parse_args
from megatron.training.hooks import TrainerHook
from megatron.training.training import Trainer
from reft_ext.store.checksum import checksum


def _raw(tensors) -> torch.Tensor:
    """The tensors' bytes one after the other, copied (the state moves on)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class Check(TrainerHook):
    def __init__(self, trainer):
        self.snap = trainer.reft.snap
        self.expected, self.compared, self.how = {}, 0, {"bubble": 0, "compute": 0,
                                                         "drain": 0}

    def _reference(self):
        """Expected region checksums from the raw state bytes, built here with torch
        alone (cat, pad, XOR), not with StateLayout or the protection's encoder: the
        replicated stream padded to D x 64 bytes (D x (D-1) x 64 for AEC) and cut into D
        slices (docs/reft.md); ARC's block is the next member's slice, AEC's the XOR of
        one sub-block of every other slice j, the k-th with this member the k-th of the
        members other than j."""
        s = self.snap
        D, m, scheme = s.D, s.member, s.protection.name
        stream = _raw(s.a.replicated_tensors())
        quantum = 64 * D * (D - 1 if scheme == "aec" else 1)
        padded = max(quantum, -(-stream.numel() // quantum) * quantum)
        slices = torch.cat([stream, torch.zeros(padded - stream.numel(), dtype=torch.uint8)]
                           ).view(D, padded // D)
        if scheme == "arc":
            red = slices[(m + 1) % D]
        elif scheme == "aec":
            S = slices.shape[1] // (D - 1)
            red = torch.zeros(S, dtype=torch.uint8)
            for j in range(D):
                if j != m:
                    k = [x for x in range(D) if x != j].index(m)
                    red ^= slices[j, k * S:(k + 1) * S]
        else:
            red = torch.empty(0, dtype=torch.uint8)
        out = {"own": checksum(slices[m].contiguous()), "redundancy": checksum(red.contiguous()),
               "owned": checksum(_raw(s.a.owned_tensors())), "aor": checksum(b"")}
        if s.aor is not None:
            s.aor.wait()
            out["aor"] = checksum(s.aor.replica.buffer)
        return out

    def after_step(self, state):  # runs after the session's after_step handed the copy over
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
    trainer.hooks.append(check)   # after REFT's session (inserted first)
    trainer.train()
    print(f"[HAS-CHECK] rank {torch.distributed.get_rank()} identical {check.compared} "
          f"bubble {check.how['bubble']} compute {check.how['compute']} "
          f"drain {check.how['drain']}", flush=True)


if __name__ == "__main__":
    main()
