"""Speech tokens -> mel by a conditional flow-matching decoder, mel -> waveform by HiFT (CosyVoice2's token2wav;
the same family decodes Chatterbox, Step-Audio-2 and GLM-4-Voice)."""
