"""The recurrent models of Rammer Table 1, with every LSTM unrolled over time.

As in the TensorFlow graphs the paper evaluates, each LSTM step is MatMul([x_t, h], W) + b, a
Split into four gates, Sigmoid/Tanh and elementwise Mul/Add (`GraphBuilder.lstm_cell`), so a
layer of T steps is T copies of that subgraph sharing one weight. Step t of layer l depends only
on step t of layer l-1 and step t-1 of layer l: the wavefront parallelism Rammer exploits.
"""

from ._builder import GraphBuilder


def split_time(g, x, steps, axis, step_shape):
    """Split `x` along its time `axis` into `steps` tensors, each reshaped to `step_shape`."""
    parts = g.node("Split", [x], n_outputs=steps, axis=axis) if steps > 1 else [x]
    return [g.reshape(p, step_shape) for p in parts]


def lstm_stack(g, xs, n_in, hidden, layers, batch, init=None):
    """Unrolled uni-directional LSTM layers over the step inputs `xs` ([batch, n_in] each).
    `init` gives per-layer initial (h, c) (zeros when None). Returns the top layer's outputs
    and each layer's final (h, c)."""
    finals = []
    zeros = None if init else g.zeros([batch, hidden])
    for layer in range(layers):
        weights = g.lstm_weights(n_in if layer == 0 else hidden, hidden)
        h, c = init[layer] if init else (zeros, zeros)
        outs = []
        for x in xs:
            h, c = g.lstm_cell(x, h, c, weights)
            outs.append(h)
        finals.append((h, c))
        xs = outs
    return xs, finals


def stack_time(g, hs, batch, hidden):
    """[batch, hidden] step outputs -> one [batch, steps, hidden] tensor."""
    return g.reshape(g.concat(hs, axis=1), [batch, len(hs), hidden])


def deepspeech2(batch=1, seq_len=300, n_freq=161, hidden=256, layers=7, conv_channels=32,
                num_classes=29, seed=0):
    """DeepSpeech2 (Amodei et al., ICML 2016) as in Rammer Table 1: input length 300, 2 CNN
    layers, 7 uni-directional LSTM layers of hidden size 256.

    Input: a spectrogram [batch, 1, n_freq=161, seq_len]. Conv 41x11 (freq x time) and 21x11,
    32 channels, stride 2 in frequency, ReLU; then the 32 * 41 features of each time step feed
    the unrolled LSTMs; an FC layer maps every top-layer output to 29 characters. Output
    [batch, seq_len, 29]. Deviations: the convs have stride 1 in time so the RNN runs the
    table's 300 steps (the original strides 2 in time in the first conv); ReLU instead of the
    clipped ReLU; no batch normalisation in the RNN (folded or omitted at inference).
    """
    g = GraphBuilder("deepspeech2", seed)
    x = g.input("input", [batch, 1, n_freq, seq_len])
    x = g.conv(x, 1, conv_channels, (41, 11), stride=(2, 1), pad=(20, 5), relu=True)
    x = g.conv(x, conv_channels, conv_channels, (21, 11), stride=(2, 1), pad=(10, 5), relu=True)
    freq = ((n_freq - 1) // 2 + 1 - 1) // 2 + 1
    n_in = conv_channels * freq
    xs = split_time(g, x, seq_len, 3, [batch, n_in])
    hs, _ = lstm_stack(g, xs, n_in, hidden, layers, batch)
    y = g.node("MatMul", [stack_time(g, hs, batch, hidden),
                          g.weight((hidden, num_classes), hidden, gain=1.0)])
    return g.build([g.add(y, g.bias(num_classes))])


def lstm_tc(batch=1, seq_len=100, input_size=256, hidden=256, layers=10, seed=0):
    """LSTM-TC (text classification LSTM) as in Rammer Table 1: input length 100, hidden 256,
    10 layers. Input: the embedded tokens [batch, seq_len, input_size]; output: the top layer's
    last hidden state [batch, hidden]. Deviation: the embedding lookup and the classifier head
    are left out (the paper's benchmark times the LSTM stack)."""
    g = GraphBuilder("lstm_tc", seed)
    x = g.input("input", [batch, seq_len, input_size])
    xs = split_time(g, x, seq_len, 1, [batch, input_size])
    hs, _ = lstm_stack(g, xs, input_size, hidden, layers, batch)
    return g.build([hs[-1]])


def seq2seq(batch=1, src_len=100, tgt_len=30, hidden=128, enc_layers=8, dec_layers=4, seed=0):
    """Seq2Seq-NMT as in Rammer Table 1: encoder uni-LSTM, input length 100, hidden 128,
    8 layers; decoder uni-LSTM, output length 30, hidden 128, 4 layers.

    Inputs: "src" [batch, src_len, hidden] and the teacher-forced decoder input "tgt"
    [batch, tgt_len, hidden] (embeddings). Decoder layer l starts from the final state of
    encoder layer enc_layers - dec_layers + l. With input feeding, decoder step t reads
    [tgt_t, top output of step t-1] (the encoder's top final h at t = 0), so the decoder's
    steps are serial as in a greedy decoder. Output: the decoder's top outputs
    [batch, tgt_len, hidden]. Deviation: embeddings and the vocabulary projection are left out.
    """
    if dec_layers > enc_layers:
        raise ValueError(f"dec_layers={dec_layers} > enc_layers={enc_layers}: each decoder "
                         "layer starts from an encoder layer's state; use dec_layers <= enc_layers")
    g = GraphBuilder("seq2seq", seed)
    src = g.input("src", [batch, src_len, hidden])
    tgt = g.input("tgt", [batch, tgt_len, hidden])
    _, enc = lstm_stack(g, split_time(g, src, src_len, 1, [batch, hidden]), hidden, hidden,
                        enc_layers, batch)
    states = enc[enc_layers - dec_layers:]
    weights = [g.lstm_weights(2 * hidden if l == 0 else hidden, hidden) for l in range(dec_layers)]
    prev, outs = enc[-1][0], []
    for x in split_time(g, tgt, tgt_len, 1, [batch, hidden]):
        inp = [x, prev]
        for l in range(dec_layers):
            states[l] = g.lstm_cell(inp, *states[l], weights[l])
            inp = states[l][0]
        prev = inp
        outs.append(prev)
    return g.build([stack_time(g, outs, batch, hidden)])
