"""Tokenizer training and BERT pre-training (MLM + NSP): writes the model folder."""
