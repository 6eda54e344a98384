"""Networks that several model families share, each named for what it is: the Mimi codec, the flow-matching
token-to-mel + HiFT vocoder family, speaker encoders, audio feature extractors and the S3 speech tokenizer."""
