"""`specdecode serve` measures adaptive K's costs before it serves, not inside the first request."""

from specdecode.cli import main
from tests.server.conftest import free_port
from tests.tiny import save_pair


def test_serve_calibrates_before_serving(tmp_path, monkeypatch):
    """Measured at the first request, the costs held it and every request queued behind it (minutes on
    a 2-core CPU) while /health answered ok. With an empty cache, the policy has its costs by the time
    the server starts listening, and they are in the cache for the next start."""
    import specdecode.server.app as app_module
    import specdecode.server.process as process

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # nothing measured before
    dirs = save_pair(tmp_path / "models", seed=41, scale=0.3, noise=0.05, max_len=512)
    seen = {}
    real_create_app = app_module.create_app

    def create_app(decoder, *args, **kwargs):
        seen["decoder"] = decoder
        return real_create_app(decoder, *args, **kwargs)

    def serve(app, host, port, **kwargs):  # instead of listening: what the first request would find
        seen["wanted"] = seen["decoder"].policy.wants_calibration()

    monkeypatch.setattr(app_module, "create_app", create_app)
    monkeypatch.setattr(process, "serve", serve)
    rc = main(["serve", "--target", dirs[0], "--draft", dirs[1], "--dtype", "float32", "--drafter", "model",
               "--port", str(free_port())])
    assert rc == 0 and seen["wanted"] is False
    assert list((tmp_path / "cache" / "calibration").glob("*.json"))  # saved for the next start
