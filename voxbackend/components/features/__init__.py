"""Audio feature extractors: Kaldi fbank and the mel spectrograms the models' front ends use."""
