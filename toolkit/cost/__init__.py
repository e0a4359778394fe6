"""What a step costs in time: hardware profiles, FLOPs from a model's shapes, collectives' time, the step-time model."""
