from kernels.dsa.reference import indexer_kl_loss, indexer_scores, select_topk, sparse_attention

__all__ = ["indexer_kl_loss", "indexer_scores", "select_topk", "sparse_attention"]
