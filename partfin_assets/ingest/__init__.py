"""The CDC writer: checkpoints into cdc.<table>, its extension points, event-time stats and the watermark."""
