"""Media generation: image pipelines (diffusers) served beside, or instead of, a text model."""
