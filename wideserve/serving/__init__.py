"""The front end: OpenAI API server, engine client, output processing, data-parallel front end, P/D
router proxy."""
