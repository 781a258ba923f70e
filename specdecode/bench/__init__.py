"""The side-by-side benchmark: prompt sets, methods (ours and Hugging Face's), harness, report."""
