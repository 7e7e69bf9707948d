"""Provider batch mode: a batch's eligible records run through the provider's own batch API (OpenAI Files +
Batches, Anthropic Message Batches) at its batch price and on its separate quota, instead of as live calls
from the relay's workers. The rest of the engine sees only items: `delegated` while a job carries them,
final like any relay-run item once its results are written (docs/provider-batches.md)."""
