"""What uvicorn + starlette with their defaults do with the hostile requests that
``tests/test_server_security.py`` sends our server (docs/scaling.md#security, "Why the
standard library's server"). Not a benchmark: a probe, run by hand in a throwaway
environment, since neither package is a dependency of this project::

    python3 -m venv /tmp/uv && /tmp/uv/bin/pip install uvicorn starlette
    /tmp/uv/bin/python benchmarks/probe_uvicorn_limits.py

It serves a two-route starlette app (``await request.json()``, as an app would) on a free
127.0.0.1 port and prints, for each attack, whether and when the server let go.
"""

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APP = '''
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

async def generate(request):
    body = await request.json()
    return JSONResponse({"type": type(body).__name__})

async def health(request):
    return JSONResponse({"ok": True})

app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)])
'''
WAIT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_line(data: bytes) -> str:
    return data.split(b"\r\n")[0].decode() or "no reply"


def until_closed(conn: socket.socket, limit: float) -> str:
    start, data = time.monotonic(), b""
    conn.settimeout(limit)
    try:
        while chunk := conn.recv(4096):
            data += chunk
        return f"closed after {time.monotonic() - start:.1f} s ({first_line(data)})"
    except TimeoutError:
        return f"still open after {limit:.0f} s ({first_line(data)})"
    except ConnectionResetError:
        return f"reset after {time.monotonic() - start:.1f} s"


def main() -> None:
    import uvicorn
    import starlette

    folder = Path(tempfile.mkdtemp())
    (folder / "app.py").write_text(APP)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "app:app", "--host", "127.0.0.1", "--port", str(port),
                               "--log-level", "critical"], cwd=folder)
    connect = lambda: socket.create_connection(("127.0.0.1", port))  # noqa: E731
    time.sleep(3)
    print(f"uvicorn {uvicorn.__version__}, starlette {starlette.__version__}, default settings")
    try:
        conn = connect()
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
        print("half-sent headers:", until_closed(conn, WAIT_S))
        conn = connect()
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{\"a\": ")
        print("body shorter than its Content-Length:", until_closed(conn, WAIT_S))
        conn, start, result = connect(), time.monotonic(), f"still open after {WAIT_S:.0f} s"
        try:
            for byte in b"POST /generate HTTP/1.1\r\nHost: t\r\n" * 10:
                conn.sendall(bytes([byte]))
                time.sleep(0.2)
                if time.monotonic() - start > WAIT_S:
                    break
        except OSError:
            result = f"dropped after {time.monotonic() - start:.1f} s"
        print("request line trickled, a byte per 0.2 s:", result)
        for length in (b"-1", b"abc", b"1000000000000"):
            conn = connect()
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: " + length + b"\r\n\r\n{}")
            print(f"Content-Length {length.decode()}:", until_closed(conn, 10))
        conn = connect()
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n\r\n[1, 2]")
        print("a JSON list for a body:", until_closed(conn, 10), "(the app's to refuse)")
        idle = [connect() for _ in range(300)]
        time.sleep(WAIT_S / 2)
        dropped = 0
        for conn in idle:
            conn.settimeout(0.01)
            try:
                dropped += conn.recv(10) == b""
            except (TimeoutError, ConnectionResetError):
                pass
        print(f"300 idle connections: {dropped} dropped by the server after {WAIT_S / 2:.0f} s")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
