"""A real SMTP server on 127.0.0.1 for the e-mail channel's tests: it speaks as much of the
dialogue as smtplib uses (EHLO/HELO, AUTH PLAIN and LOGIN, MAIL FROM, RCPT TO, DATA with
dot-unstuffing, RSET, NOOP, QUIT, and STARTTLS when given a certificate), keeps every line the
client sent (``transcript``, to show where a password travelled) and every message it
accepted (``messages``, parsed by the standard library's e-mail parser).

Its own because the standard library's server (smtpd) is deprecated and gone from Python 3.12.
"""

from __future__ import annotations

import base64
import socket
import ssl
import threading
from email import policy
from email.parser import BytesParser


class SMTPReceiver:
    def __init__(self, user: str | None = None, password: str | None = None, certfile: str | None = None,
                 keyfile: str | None = None):
        self.user, self.password = user, password
        self.tls = None
        if certfile:
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(certfile, keyfile)
        self.transcript: list[bytes] = []  # every line the client sent, as sent (on the wire or in TLS)
        self.auth: list[tuple[str, str]] = []  # (user, password) of each successful AUTH
        self.messages: list[dict] = []  # {mail_from, rcpt_to, message (email.message.EmailMessage)}
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        fh = conn.makefile("rb")

        def say(line: str) -> None:
            conn.sendall(line.encode() + b"\r\n")

        def read() -> bytes | None:
            raw = fh.readline(65536)
            if not raw:
                return None
            with self._lock:
                self.transcript.append(raw)
            return raw.rstrip(b"\r\n")

        try:
            say("220 127.0.0.1 test SMTP")
            authed, mail_from, rcpt = self.user is None, None, []
            while (line := read()) is not None:
                verb, _, arg = line.decode("utf-8", "replace").partition(" ")
                verb = verb.upper()
                if verb in ("EHLO", "HELO"):
                    if verb == "HELO":
                        say("250 127.0.0.1")
                        continue
                    caps = ["127.0.0.1", "8BITMIME", "AUTH PLAIN LOGIN"]
                    if self.tls and not isinstance(conn, ssl.SSLSocket):
                        caps.append("STARTTLS")
                    for c in caps[:-1]:
                        say(f"250-{c}")
                    say(f"250 {caps[-1]}")
                elif verb == "STARTTLS" and self.tls:
                    say("220 go ahead")
                    fh.close()
                    try:
                        conn = self.tls.wrap_socket(conn, server_side=True)
                    except (ssl.SSLError, OSError):
                        return  # the client refused our certificate: it sends nothing more
                    fh = conn.makefile("rb")
                elif verb == "AUTH":
                    mech, _, initial = arg.partition(" ")
                    if mech.upper() == "PLAIN":
                        if not initial:
                            say("334 ")
                            initial = (read() or b"").decode()
                        _, user, password = base64.b64decode(initial).decode().split("\0")
                    elif mech.upper() == "LOGIN":
                        if initial:
                            user = base64.b64decode(initial).decode()
                        else:
                            say("334 " + base64.b64encode(b"Username:").decode())
                            user = base64.b64decode(read() or b"").decode()
                        say("334 " + base64.b64encode(b"Password:").decode())
                        password = base64.b64decode(read() or b"").decode()
                    else:
                        say("504 unrecognised authentication type")
                        continue
                    if (user, password) == (self.user, self.password):
                        authed = True
                        with self._lock:
                            self.auth.append((user, password))
                        say("235 authentication successful")
                    else:
                        say("535 authentication credentials invalid")
                elif verb == "MAIL":
                    if not authed:
                        say("530 authentication required")
                        continue
                    mail_from, rcpt = arg.partition(":")[2].strip().split(" ")[0].strip("<>"), []
                    say("250 OK")
                elif verb == "RCPT":
                    rcpt.append(arg.partition(":")[2].strip().strip("<>"))
                    say("250 OK")
                elif verb == "DATA":
                    say("354 end data with <CR><LF>.<CR><LF>")
                    lines = []
                    while (body := fh.readline(1 << 20)) not in (b".\r\n", b".\n", b""):
                        with self._lock:
                            self.transcript.append(body)
                        lines.append(body[1:] if body.startswith(b"..") else body)
                    msg = BytesParser(policy=policy.default).parsebytes(b"".join(lines).replace(b"\r\n", b"\n"))
                    with self._lock:
                        self.messages.append({"mail_from": mail_from, "rcpt_to": rcpt, "message": msg})
                    say("250 OK queued")
                elif verb == "RSET":
                    mail_from, rcpt = None, []
                    say("250 OK")
                elif verb == "NOOP":
                    say("250 OK")
                elif verb == "QUIT":
                    say("221 bye")
                    return
                else:
                    say("502 command not implemented")
        except (OSError, ValueError):
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass
