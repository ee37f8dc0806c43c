"""chunkwise's client side: the SDK (`Client`, `AsyncClient`), the local stack launcher
(`client.serve`) and the command line (`client.cli`)."""

from client.sdk import AsyncClient, Chunk, ChunkwiseError, Client, GenerationResult, TokenLogprob, Usage

__all__ = ["AsyncClient", "Chunk", "ChunkwiseError", "Client", "GenerationResult", "TokenLogprob", "Usage"]
