"""Linear-attention recurrences: one gated delta-rule engine in three forms (token by token, chunked in torch,
a Triton chunk kernel), document-exact for packed sequences, and the Gated DeltaNet layer built on it
(docs/linear-attention.md)."""
