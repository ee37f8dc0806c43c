"""chunkwise's SDK (`Client`, `AsyncClient`) and the `chunkwise` command (`client.cli`). The
launcher, soak and load tester are in `chunkwise_tools`, which the SDK never imports."""

from client.sdk import AsyncClient, Chunk, ChunkwiseError, Client, GenerationResult, TokenLogprob, Usage

__all__ = ["AsyncClient", "Chunk", "ChunkwiseError", "Client", "GenerationResult", "TokenLogprob", "Usage"]
