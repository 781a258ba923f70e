"""The lossless audit: statistical evidence that speculative decoding samples exactly from the target."""

from specdecode.audit.run import AuditConfig, AuditReport, run_audit

__all__ = ["AuditConfig", "AuditReport", "run_audit"]
