"""Watermark semantics: policies (a value each, chosen by name from `registry`), the step both the writer's
WatermarkProcessor and the policy lab's replay run (`step`), a policy's recorded changes (`change`)."""
