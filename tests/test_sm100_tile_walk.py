"""CPU: the static persistent schedule of the sm_100a kernels (`kernels/sm100/persistent.py`), by its arithmetic on
plain ints: over every CTA of the grid `schedule` launches, each output tile of the cluster-padded tile grid is
computed exactly once, the CTAs of a cluster take one cluster-shaped block of tiles together, and the blocks go M
fastest, then N, then L."""

import itertools
import random

from absl.testing import absltest, parameterized

from jax_blockgemm.kernels.sm100.persistent import tile_of


def _walk(tiles_mnl, cluster_mn, clusters_in_grid):
    """{CTA (x, y, z): its tiles in order}, the kernel's loop on ints: block z, z + clusters, ... below the count."""
    counts = (-(-tiles_mnl[0] // cluster_mn[0]), -(-tiles_mnl[1] // cluster_mn[1]), tiles_mnl[2])
    blocks = counts[0] * counts[1] * counts[2]
    walks = {}
    for x, y, z in itertools.product(range(cluster_mn[0]), range(cluster_mn[1]), range(clusters_in_grid)):
        walks[x, y, z] = [tile_of(i, counts[:2], cluster_mn, (x, y)) for i in range(z, blocks, clusters_in_grid)]
    return counts, walks


class TileWalkTest(parameterized.TestCase):

    @parameterized.product(cluster_mn=[(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)], clusters_in_grid=[1, 3, 7, 148])
    def test_every_tile_once(self, cluster_mn, clusters_in_grid):
        rng = random.Random(hash((cluster_mn, clusters_in_grid)) % 2**32)
        for _ in range(5):
            tiles = (rng.randint(1, 13), rng.randint(1, 9), rng.randint(1, 3))
            counts, walks = _walk(tiles, cluster_mn, clusters_in_grid)
            visited = [t for w in walks.values() for t in w]
            padded = itertools.product(range(counts[0] * cluster_mn[0]), range(counts[1] * cluster_mn[1]),
                                       range(tiles[2]))
            self.assertCountEqual(visited, list(padded))  # each tile once (past M or N only inside a cluster)

    def test_cluster_takes_one_block_and_order_is_m_then_n_then_l(self):
        counts, walks = _walk((5, 4, 2), (2, 2), 3)
        for z in range(3):
            for step in range(len(walks[0, 0, z])):
                block = {walks[x, y, z][step] for x in range(2) for y in range(2)}
                m0, n0, l0 = walks[0, 0, z][step]
                self.assertEqual(block, {(m0 + x, n0 + y, l0) for x in range(2) for y in range(2)})
        firsts = [walks[0, 0, z][0] for z in range(3)]  # blocks 0, 1, 2: along M first
        self.assertEqual(firsts, [(0, 0, 0), (2, 0, 0), (4, 0, 0)])
        self.assertEqual(walks[0, 0, 0][1], (0, 2, 0))  # block 3 = (M block 0, N block 1): M has 3 blocks
        self.assertEqual(walks[0, 0, 0][2], (0, 0, 1))  # block 6: the second batch


if __name__ == "__main__":
    absltest.main()
