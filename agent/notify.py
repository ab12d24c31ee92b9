"""Channels: how an alert (agent/alerts.py) reaches a person. One function per channel type,
each sending one alert once and raising :class:`SendError` with a one-line reason.

Used by the agent in the container and by `ctl watch` on the operator's machine, so
standard library only (urllib, smtplib, subprocess).

Secrets by reference only: a channel's config names environment variables (``url_env``,
``token_env``, ``password_env``); their values are looked up in ``env`` at send time and never
written anywhere. An error text never carries them: every reason is scrubbed of every secret
value before it leaves this module (a URL with a token in its path would otherwise be
echoed by an error message into the delivery log).
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from typing import Any, Mapping

from agent.alerts import Alert

CHANNEL_TYPES = ("webhook", "slack", "ntfy", "email", "command")
# Per type: keys that name an environment variable (the secret itself is never in the config),
# keys that are plain settings, and which of either are required.
SECRET_KEYS = {"webhook": ("url_env",), "slack": ("url_env",), "ntfy": ("token_env",),
               "email": ("password_env",), "command": ()}
PLAIN_KEYS = {"webhook": ("timeout_s",), "slack": ("timeout_s",),
              "ntfy": ("server", "topic", "timeout_s"),
              "email": ("host", "port", "starttls", "ssl", "cafile", "user", "sender", "to", "timeout_s"),
              "command": ("argv", "timeout_s")}
REQUIRED = {"webhook": ("url_env",), "slack": ("url_env",), "ntfy": ("server", "topic"),
            "email": ("host", "sender", "to"), "command": ("argv",)}
COMMON_KEYS = ("type", "enabled", "kinds")  # kinds: only these alert kinds (default: all)
DEFAULT_TIMEOUT_S = 10.0
NTFY_TOPIC = re.compile(r"[-_A-Za-z0-9]{1,64}")  # ntfy's own rule for a topic name
USER_AGENT = "dflash-ctl-alerts/1"


class SendError(Exception):
    """One delivery attempt failed; the message is one line without any secret in it."""


def check_channel(name: str, ch: Any) -> dict:
    """A channel table as the config gives it, checked: the type known, every key known, the
    required ones there, ``*_env`` values environment variable NAMES (a URL there is a secret
    pasted in the wrong place, refused so that it is never copied into a run)."""
    where = f"notify.channels.{name}"
    if not isinstance(ch, dict):
        raise ValueError(f"{where}: must be a table (got {ch!r})")
    kind = ch.get("type")
    if kind not in CHANNEL_TYPES:
        raise ValueError(f"{where}.type: must be one of {', '.join(CHANNEL_TYPES)} (got {kind!r})")
    known = set(COMMON_KEYS) | set(SECRET_KEYS[kind]) | set(PLAIN_KEYS[kind])
    for key, value in ch.items():
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown key for a {kind} channel (known: {', '.join(sorted(known))})")
        if key.endswith("_env") and (not isinstance(value, str) or not value.replace("_", "").isalnum()
                                     or value[0].isdigit()):
            raise ValueError(f"{where}.{key}: must be the NAME of an environment variable that holds the secret, "
                             f"e.g. ALERT_WEBHOOK_URL (the value itself never goes in a file)")
    for key in REQUIRED[kind]:
        if key not in ch:
            raise ValueError(f"{where}.{key}: required for a {kind} channel")
    if kind == "command" and (not isinstance(ch["argv"], list) or not ch["argv"]
                              or not all(isinstance(a, str) for a in ch["argv"])):
        raise ValueError(f"{where}.argv: must be a list of strings, the command and its arguments")
    if kind == "email" and not (isinstance(ch["to"], list) and ch["to"] and all(isinstance(a, str) for a in ch["to"])):
        raise ValueError(f"{where}.to: must be a list of addresses")
    if kind == "ntfy" and not (isinstance(ch["topic"], str) and NTFY_TOPIC.fullmatch(ch["topic"])):
        raise ValueError(f"{where}.topic: must be 1 to 64 letters, digits, '-' or '_' (ntfy's topic names; "
                         f"got {ch['topic']!r})")
    return dict(ch)


def takes(ch: dict, alert: Alert) -> bool:
    """Whether channel ``ch`` is to get ``alert``: not switched off, and of a kind it lists
    (``kinds``; none listed: every kind). The one test of a channel's filter, for the agent's
    deliveries and for what ``ctl watch`` is owed (agent/alertwatch.py ``owed``)."""
    if ch.get("enabled") is False:
        return False
    kinds = ch.get("kinds")
    return not kinds or alert.kind in kinds


def channel_filter(ch: dict) -> dict:
    """The part of a channel ``takes`` reads: what ``ctl watch`` tells the container about its
    own channels (no host, address or variable name travels for it)."""
    return {k: ch[k] for k in ("enabled", "kinds") if k in ch}


def secret_names(channels: Mapping[str, dict]) -> list[str]:
    """The environment variable names the channels read."""
    out = []
    for ch in channels.values():
        for key in SECRET_KEYS.get(ch.get("type"), ()):
            if ch.get(key) and ch[key] not in out:
                out.append(ch[key])
    return out


def webhook_body(alert: Alert) -> dict:
    """The generic webhook's JSON body (docs/alerts.md documents it): the alert record, plus
    ``text`` (its human form) and ``version``."""
    return {"version": 1, **alert.to_json(), "text": alert.text()}


def slack_text(alert: Alert) -> str:
    """The alert's text for a Slack-compatible receiver: Slack reads ``&``, ``<`` and ``>`` as
    control characters (``<...>`` is a link or a mention), so exactly those three are escaped
    as its formatting reference says; everything else goes as it is."""
    return alert.text().replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _scrub(text: str, secrets: list[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return " ".join(text.split())[:300]


def _need(ch: dict, key: str, env: Mapping[str, str]) -> str:
    name = ch.get(key)
    value = env.get(name) if name else None
    if not value:
        raise SendError(f"${name} is not set where this delivery runs")
    return value


def _post(url: str, data: bytes, headers: dict, timeout: float) -> None:
    req = urllib.request.Request(url, data=data, method="POST", headers={"User-Agent": USER_AGENT, **headers})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the operator's own URL
        resp.read(65536)


def send(alert: Alert, ch: dict, env: Mapping[str, str]) -> None:
    """Send ``alert`` once through channel ``ch``; SendError (scrubbed) when it did not arrive."""
    secrets = [env.get(ch[k], "") for k in SECRET_KEYS.get(ch.get("type"), ()) if ch.get(k)]
    try:
        _send(alert, ch, env)
    except SendError as exc:
        raise SendError(_scrub(str(exc), secrets)) from None
    except urllib.error.HTTPError as exc:
        raise SendError(f"HTTP {exc.code} {_scrub(str(exc.reason), secrets)}") from None
    except urllib.error.URLError as exc:
        raise SendError(_scrub(f"cannot reach the receiver: {exc.reason}", secrets)) from None
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise SendError(_scrub(f"{type(exc).__name__}: {exc}", secrets)) from None
    except Exception as exc:  # noqa: BLE001 - smtplib's own errors and the like: one line, never a crash
        raise SendError(_scrub(f"{type(exc).__name__}: {exc}", secrets)) from None


def _send(alert: Alert, ch: dict, env: Mapping[str, str]) -> None:
    kind = ch["type"]
    timeout = float(ch.get("timeout_s") or DEFAULT_TIMEOUT_S)
    if kind == "webhook":
        _post(_need(ch, "url_env", env), json.dumps(webhook_body(alert)).encode(),
              {"Content-Type": "application/json", "X-Alert-Id": alert.id}, timeout)
    elif kind == "slack":
        # Slack's incoming webhook takes {"text": ...}; the id is in the text (the body is all
        # a Slack-compatible receiver keeps).
        _post(_need(ch, "url_env", env), json.dumps({"text": slack_text(alert)}).encode(),
              {"Content-Type": "application/json"}, timeout)
    elif kind == "ntfy":
        # ntfy's publish API: the message is the body; title, priority and tags are headers
        headers = {"Content-Type": "text/plain; charset=utf-8", "Title": alert.title(), "Tags": alert.kind,
                   "X-Alert-Id": alert.id,
                   "Priority": "high" if alert.severity == "error" else "default"}
        if ch.get("token_env"):
            headers["Authorization"] = f"Bearer {_need(ch, 'token_env', env)}"
        url = f"{str(ch['server']).rstrip('/')}/{ch['topic']}"
        _post(url, alert.text().encode(), headers, timeout)
    elif kind == "email":
        _email(alert, ch, env, timeout)
    elif kind == "command":
        # The alert goes on stdin (JSON, the webhook's body), never on the command line.
        proc = subprocess.run(list(ch["argv"]), input=json.dumps(webhook_body(alert)), text=True,
                              capture_output=True, timeout=timeout, env={**_plain_env(env), "DFLASH_ALERT_ID": alert.id,
                                                                         "DFLASH_ALERT_KIND": alert.kind})
        if proc.returncode != 0:
            raise SendError(f"{ch['argv'][0]} exited {proc.returncode}: {(proc.stderr or '').strip()[-200:]}")
    else:
        raise SendError(f"unknown channel type {kind!r}")


def _plain_env(env: Mapping[str, str]) -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "USER")}


def _email(alert: Alert, ch: dict, env: Mapping[str, str], timeout: float) -> None:
    import smtplib
    import ssl
    from email.message import EmailMessage

    msg = EmailMessage()
    msg["Subject"] = alert.title()
    msg["From"] = ch["sender"]
    msg["To"] = ", ".join(ch["to"])
    msg["Message-ID"] = f"<{alert.id}@dflash-ctl>"  # the id: a mail client threads repeats as one
    msg["X-Alert-Id"] = alert.id
    msg.set_content(alert.text())
    port = int(ch.get("port") or (465 if ch.get("ssl") else 587 if ch.get("starttls") else 25))
    # smtplib's own default context checks neither the certificate nor the host name: a
    # man in the middle would get the password. Verified against the system's CAs, or the
    # operator's own (cafile) for a private server.
    tls = ssl.create_default_context(cafile=ch.get("cafile") or None)
    with (smtplib.SMTP_SSL(ch["host"], port, timeout=timeout, context=tls) if ch.get("ssl")
          else smtplib.SMTP(ch["host"], port, timeout=timeout)) as smtp:
        if ch.get("starttls"):
            smtp.starttls(context=tls)
        if ch.get("user"):
            smtp.login(ch["user"], _need(ch, "password_env", env))
        smtp.send_message(msg)
