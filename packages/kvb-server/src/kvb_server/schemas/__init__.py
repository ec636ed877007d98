"""Request and response bodies of the OpenAI-compatible routes, as pydantic models (the OpenAPI document's
schemas), one module per group of routes; :mod:`.fields` holds the constrained types they share."""
