"""Host-side figures built from the reduced statistics: the summary, spikes, the per-rank view,
anomaly warnings, the norm auditor and the reporter."""
