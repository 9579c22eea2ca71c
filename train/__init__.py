"""specdistill training side: recipes, model loading, generation, losses, the distill loop, export."""
