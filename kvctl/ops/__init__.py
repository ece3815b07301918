"""Operating a deployment: the doctor's one-pass checks, the Prometheus exporter and the run report.
"""
