"""Wire format: graph documents, tensor frames and message schemas (no pickle, ever)."""
