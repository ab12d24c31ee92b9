"""Each channel of agent/notify.py delivers one alert to a real receiver on 127.0.0.1 and is
checked against what its service documents: Slack's incoming webhook (``{"text": ...}``,
``&``/``<``/``>`` escaped), ntfy's publish API (POST /<topic>, the message as the body,
Title/Priority/Tags headers), an SMTP server (a real dialogue: EHLO, AUTH, MAIL, RCPT, DATA;
STARTTLS with a checked certificate), and the local command (the webhook body on stdin)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from agent.alerts import Alert, alert_id
from agent.notify import SendError, check_channel, send, webhook_body
from tests._alert_receiver import Receiver
from tests._smtp_receiver import SMTPReceiver

TOKEN = "s3cr3t-T0KEN-9f8e7d"
PASSWORD = "pa55-W0RD-4c3b2a"
RUN = "r1-20261201-114702-0001"


def failed_alert() -> Alert:
    # a cause with each of Slack's control characters and a non-ASCII one
    return Alert(id=alert_id(RUN, "failed", "end"), kind="failed", run=RUN, ts=1764589622.41, node="pve1",
                 container="200", severity="error", step=1843,
                 cause="rank_exit: rank 6 (pid 48121, GPU 6) killed by signal 9 <not by us> & no checkpoint … saved",
                 next=f"ctl tail --node pve1 --container 200 --run {RUN}")


def completed_alert() -> Alert:
    return Alert(id=alert_id(RUN, "completed", "end"), kind="completed", run=RUN, ts=1764589700.0, node="pve1",
                 container="200", severity="info", step=2000, cause="completed at step 2000",
                 next=f"ctl status --node pve1 --container 200 --run {RUN}")


@pytest.fixture
def receiver(request):
    r = Receiver(path=request.param)
    yield r
    r.down()


@pytest.mark.parametrize("receiver", [f"/services/T0/B0/{TOKEN}"], indirect=True)
def test_slack_gets_one_json_text_with_slacks_control_characters_escaped(receiver):
    alert = failed_alert()
    ch = check_channel("slack", {"type": "slack", "url_env": "SLACK_WEBHOOK_URL"})
    send(alert, ch, {"SLACK_WEBHOOK_URL": receiver.url})
    [req] = receiver.requests_seen
    assert req["path"] == f"/services/T0/B0/{TOKEN}"
    assert req["headers"]["Content-Type"] == "application/json"
    body = json.loads(req["body"])
    assert list(body) == ["text"]  # Slack's incoming webhook: the text is the message
    text = body["text"]
    assert "killed by signal 9 &lt;not by us&gt; &amp; no checkpoint … saved" in text
    assert "<" not in text and ">" not in text and "& " not in text
    assert text.startswith(f"[error] run {RUN} on pve1:200: failed\n") and f"alert id: {alert.id}" in text
    assert text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&") == alert.text()


@pytest.mark.parametrize("receiver", ["/dflash-runs"], indirect=True)
def test_ntfy_gets_a_post_to_its_topic_with_the_text_as_body_and_title_priority_tags_headers(receiver):
    ch = check_channel("phone", {"type": "ntfy", "server": f"http://127.0.0.1:{receiver.port}/",
                                 "topic": "dflash-runs", "token_env": "NTFY_TOKEN"})
    failed, completed = failed_alert(), completed_alert()
    send(failed, ch, {"NTFY_TOKEN": TOKEN})
    send(completed, ch, {"NTFY_TOKEN": TOKEN})
    first, second = receiver.requests_seen
    assert first["path"] == second["path"] == "/dflash-runs"
    assert first["body"] == failed.text().encode("utf-8")  # the message itself, not JSON
    h = first["headers"]
    assert h["Content-Type"] == "text/plain; charset=utf-8"
    assert h["Title"] == f"[error] run {RUN} on pve1:200: failed"
    assert h["Priority"] == "high" and second["headers"]["Priority"] == "default"  # ntfy's named levels
    assert h["Tags"] == "failed" and second["headers"]["Tags"] == "completed"
    assert h["Authorization"] == f"Bearer {TOKEN}" and h["X-Alert-Id"] == failed.id
    assert second["body"].decode() == completed.text()


def test_an_ntfy_topic_ntfy_would_not_take_is_refused_by_name():
    with pytest.raises(ValueError, match=r"notify.channels.phone.topic: must be 1 to 64 letters"):
        check_channel("phone", {"type": "ntfy", "server": "https://ntfy.sh", "topic": "runs/../admin"})


def _mail_channel(port: int, **kw) -> dict:
    return check_channel("mail", {"type": "email", "host": "127.0.0.1", "port": port, "user": "alerts@example.org",
                                  "password_env": "SMTP_PASSWORD", "sender": "alerts@example.org",
                                  "to": ["ops@example.org", "oncall@example.org"], **kw})


def _secret_forms(secret: str) -> list[bytes]:
    """The password as it could leak: plain, and base64 alone or inside an AUTH PLAIN string."""
    return [secret.encode(), base64.b64encode(secret.encode()),
            base64.b64encode(f"\0alerts@example.org\0{secret}".encode())]


def test_email_arrives_with_subject_body_and_id_and_the_password_travels_only_as_auth():
    smtp = SMTPReceiver(user="alerts@example.org", password=PASSWORD)
    try:
        alert = failed_alert()
        send(alert, _mail_channel(smtp.port), {"SMTP_PASSWORD": PASSWORD})
        [got] = smtp.messages
        msg = got["message"]
        assert got["mail_from"] == "alerts@example.org"
        assert got["rcpt_to"] == ["ops@example.org", "oncall@example.org"]
        assert msg["Subject"] == alert.title() and msg["To"] == "ops@example.org, oncall@example.org"
        assert msg["Message-ID"] == f"<{alert.id}@dflash-ctl>" and msg["X-Alert-Id"] == alert.id
        assert msg.get_content().rstrip("\n") == alert.text()
        assert smtp.auth == [("alerts@example.org", PASSWORD)]
        auth = [line for line in smtp.transcript if line.upper().startswith(b"AUTH ")]
        rest = b"".join(line for line in smtp.transcript if not line.upper().startswith(b"AUTH "))
        assert len(auth) == 1 and PASSWORD.encode() in base64.b64decode(auth[0].split()[2])
        assert not any(form in rest for form in _secret_forms(PASSWORD))
    finally:
        smtp.close()


def test_a_refused_password_is_a_one_line_failure_without_the_password():
    smtp = SMTPReceiver(user="alerts@example.org", password="the-right-one")
    try:
        with pytest.raises(SendError) as exc:
            send(failed_alert(), _mail_channel(smtp.port), {"SMTP_PASSWORD": PASSWORD})
        assert "535" in str(exc.value) and "\n" not in str(exc.value)
        assert not any(form.decode() in str(exc.value) for form in _secret_forms(PASSWORD))
        assert not smtp.messages
    finally:
        smtp.close()


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (the server's); no CA anywhere knows it."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return str(d / "cert.pem"), str(d / "key.pem")


def test_starttls_checks_the_certificate_before_the_password_is_sent(cert):
    certfile, keyfile = cert
    smtp = SMTPReceiver(user="alerts@example.org", password=PASSWORD, certfile=certfile, keyfile=keyfile)
    try:
        # a certificate nobody vouches for: refused, and the password never left
        with pytest.raises(SendError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            send(failed_alert(), _mail_channel(smtp.port, starttls=True), {"SMTP_PASSWORD": PASSWORD})
        assert not smtp.auth and not smtp.messages
        assert not any(line.upper().startswith(b"AUTH") for line in smtp.transcript)
        # the operator's own CA (cafile): delivered, the AUTH inside TLS
        alert = completed_alert()
        send(alert, _mail_channel(smtp.port, starttls=True, cafile=certfile), {"SMTP_PASSWORD": PASSWORD})
        assert [m["message"]["X-Alert-Id"] for m in smtp.messages] == [alert.id]
        assert smtp.auth == [("alerts@example.org", PASSWORD)]
    finally:
        smtp.close()


def test_the_command_channel_gets_the_webhook_body_on_stdin_the_id_and_kind_in_its_environment(tmp_path):
    out = tmp_path / "got.json"
    script = ("import json, os, sys; json.dump({'stdin': json.load(sys.stdin), 'argv': sys.argv[1:], "
              "'id': os.environ.get('DFLASH_ALERT_ID'), 'kind': os.environ.get('DFLASH_ALERT_KIND'), "
              f"'secret': os.environ.get('SMTP_PASSWORD')}}, open({str(out)!r}, 'w'))")
    alert = failed_alert()
    send(alert, check_channel("pager", {"type": "command", "argv": [sys.executable, "-c", script, "a b"]}),
         {"SMTP_PASSWORD": PASSWORD})
    got = json.loads(out.read_text())
    assert got["stdin"] == json.loads(json.dumps(webhook_body(alert)))
    assert got["argv"] == ["a b"] and got["id"] == alert.id and got["kind"] == "failed"
    assert got["secret"] is None  # the other channels' secrets are not handed to the command
    fail = [sys.executable, "-c", "import sys; sys.stderr.write('pager down\\n'); sys.exit(3)"]
    with pytest.raises(SendError, match=r"exited 3: pager down$"):
        send(alert, {"type": "command", "argv": fail}, {})
