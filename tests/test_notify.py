"""sd_notify: the exact datagrams systemd would read, on a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from autotune.daemon import notify


def _receive(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    return sock.recv(4096)


@pytest.fixture
def path_socket(monkeypatch) -> Iterator[socket.socket]:
    """A socket at a file system path, as systemd's /run/systemd/notify.

    In a short directory of its own: an AF_UNIX path has at most 107 bytes, and pytest's
    tmp_path can be longer than that on some machines.
    """
    with tempfile.TemporaryDirectory(prefix="sdn-", dir="/tmp" if os.path.isdir("/tmp") else None) as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield sock
        sock.close()


@pytest.fixture
def abstract_socket(monkeypatch) -> Iterator[socket.socket]:
    """A socket in the abstract namespace: NOTIFY_SOCKET=@name means b"\\0name"."""
    name = f"autotune-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield sock
    sock.close()


def test_helpers_send_the_exact_datagrams(path_socket):
    assert notify.ready() is True
    assert _receive(path_socket) == b"READY=1"
    assert notify.status("studying: trial 12 of 40") is True
    assert _receive(path_socket) == b"STATUS=studying: trial 12 of 40"
    assert notify.watchdog() is True
    assert _receive(path_socket) == b"WATCHDOG=1"
    assert notify.stopping() is True
    assert _receive(path_socket) == b"STOPPING=1"


def test_several_fields_are_one_datagram_in_order(path_socket):
    assert notify.notify(READY=1, STATUS="up", MAINPID=os.getpid()) is True
    assert _receive(path_socket) == f"READY=1\nSTATUS=up\nMAINPID={os.getpid()}".encode()


def test_status_is_one_line(path_socket):
    notify.status("first\nsecond")
    assert _receive(path_socket) == b"STATUS=first second"


def test_abstract_namespace(abstract_socket):
    assert notify.ready() is True
    assert _receive(abstract_socket) == b"READY=1"
    assert notify.watchdog() is True
    assert _receive(abstract_socket) == b"WATCHDOG=1"


def test_without_notify_socket_everything_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.ready() is False
    assert notify.status("x") is False
    assert notify.watchdog() is False
    assert notify.stopping() is False
    assert notify.notify(READY=1) is False


def test_unsupported_transport_is_a_no_op(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert notify.ready() is False


def test_unreachable_socket_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    with pytest.raises(OSError):
        notify.ready()


def test_bad_fields_are_refused(path_socket):
    with pytest.raises(ValueError):
        notify.notify(STATUS="two\nlines")
    with pytest.raises(ValueError):
        notify.notify(status="lower case")
    with pytest.raises(ValueError):
        notify.notify()


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("60000000", None, 60.0),
        ("60000000", "self", 60.0),
        ("1500000", "", 1.5),
        ("60000000", "other", None),  # inherited by a child: not the watched process
        ("0", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(monkeypatch, usec, pid, expected):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    if usec is not None:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(pid, pid))
    assert notify.watchdog_interval() == expected
