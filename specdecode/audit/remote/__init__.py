"""The black-box audit: certify over HTTP that an OpenAI-compatible endpoint's speculative decoding is
lossless (its law with speculation on equals its law with speculation off)."""

from specdecode.audit.remote.client import EndpointError, Side
from specdecode.audit.remote.plan import Prompt, Setting
from specdecode.audit.remote.report import RemoteReport
from specdecode.audit.remote.run import RemoteConfig, run_remote_audit

__all__ = ["EndpointError", "Prompt", "RemoteConfig", "RemoteReport", "Setting", "Side", "run_remote_audit"]
