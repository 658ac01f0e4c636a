"""A short English passage (written for this package, no third-party text) that ``ringtune parity run`` cuts its
natural-text rows from; rows longer than the passage repeat it, as the comparable system's client did."""

PASSAGE = """\
The old stone bridge at the edge of the town had stood for more than two hundred years, and most of the people who
crossed it every morning never thought about it at all. It carried carts, then cars, then the heavy lorries that
brought grain from the farms in the valley, and it carried the children who walked to school in small noisy groups,
stopping in the middle to drop sticks into the water and run to the other side to see which one came out first.

The river below was shallow in summer and fast in spring. When the snow melted on the hills it rose quickly, brown
and loud, and the water pressed against the piers until the whole bridge seemed to hum. The engineers who built it
had understood this. They set the piers on wide foundations, shaped their upstream faces into points that split the
current, and left the arches high enough for the floods of their own time. Nobody had told them how large the
floods of the future would be, but they had guessed generously, and for two centuries the guess was good enough.

A bridge is a patient machine. It does nothing, and doing nothing well is harder than it sounds. Every stone pushes
on its neighbours, and every neighbour pushes back, so that the weight of a passing lorry travels down through the
arch in a curve that no one can see. If one stone moves, the curve must find another path. Most of the time it
does. The masons knew which stones mattered most, and they cut those with the greatest care, fitting each one so
closely that a knife blade could not pass between them.

In the town library there is a small book, written by the grandson of one of those masons, that describes how the
work was done. The river was turned aside with walls of timber and clay, and the men dug down through gravel until
they reached the rock. They worked by lamplight in the autumn when the water was lowest, and they counted the days
until the rains. When the first arch was closed, the whole town came out to watch the wooden frame beneath it
lowered away, and there was a long silence before anyone dared to cheer, because everyone was waiting to hear a
crack. None came.

Much later, when the town grew, the council argued for years about whether to replace the bridge with something
wider. Some said it was too narrow for modern traffic and too old to trust. Others said that it had carried more
weight than any new bridge would ever be asked to carry, and that its age was the best evidence of its strength.
In the end they built a second bridge a little way downstream for the lorries and left the old one for people on
foot and on bicycles. On warm evenings it is full of them, leaning on the parapet, watching the swallows skim the
water and the light go gold and then grey over the hills.

Engineers still come to look at it. They measure the piers, take samples of the mortar, and run numbers through
programs that the masons could not have imagined. The numbers usually agree with the stones: the bridge is sound.
What the programs cannot say is why the masons chose exactly those proportions, or how they knew, without any of
the mathematics that would later describe their work, that the arch would stand. Perhaps they learned it from
bridges that fell. Perhaps they simply watched the river for a long time before they began.
"""
