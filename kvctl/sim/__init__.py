"""What-if: the single-engine queue (simulate), fleets of engines on one tier (fleet), the planner (plan), the
variability fitted from measurements, the calibration from a run, and the model built from a command's inputs.
"""
