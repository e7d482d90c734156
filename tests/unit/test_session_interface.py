"""One session interface for REFT on and off: the in-process restart calls abandon() on
whatever session the trainer holds, so a method that one of them lacks (DisabledSession
had no abandon) turns a restart into an AttributeError and a process restart."""

from __future__ import annotations

import inspect

from reft_ext.session import DisabledSession, ReftSession, Session


def _public(cls) -> dict:
    return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, callable)
            if not n.startswith("_")}


def test_both_sessions_implement_the_whole_interface_with_the_same_signatures():
    wanted = _public(Session)
    assert {"abandon", "recover", "on_start", "after_step", "on_exit", "close"} <= set(wanted)
    for cls in (DisabledSession, ReftSession):
        assert issubclass(cls, Session) and not getattr(cls, "__abstractmethods__", None), cls
        got = _public(cls)
        for name, sig in wanted.items():
            assert name in got, f"{cls.__name__} lacks {name}"
            assert list(got[name].parameters) == list(sig.parameters), \
                f"{cls.__name__}.{name}{got[name]} != Session.{name}{sig}"
    # nothing a trainer may call on REFT's session is missing from the interface
    extra = set(_public(ReftSession)) - set(wanted)
    assert not extra, f"ReftSession's public methods outside Session: {sorted(extra)}"


def test_disabled_session_abandons_and_closes_quietly():
    s = DisabledSession()
    s.abandon()
    s.close()
    assert not s.enabled and s.summary(None) == "" and s.recover(3) is None
