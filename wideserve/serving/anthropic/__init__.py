"""Anthropic's Messages API (`/v1/messages`) served over the OpenAI chat path; see
docs/anthropic.md."""
