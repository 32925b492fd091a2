"""Speculative decoding on the coordinator: who proposes tokens, and when a request speculates."""
