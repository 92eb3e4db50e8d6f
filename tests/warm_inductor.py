"""Imported last by tests/forked_cli.py's fork server, after torch: fills inductor's per-process
caches once and hides the server's objects from the garbage collector (tests/zygote.py:
before_forking), so that no forked command pays either again."""

from tests.zygote import before_forking

before_forking()
